//! `Direct<S>`: the uncached allocator, one source call per allocation. It is what the
//! handles used before the caching pool, the "raw" row of A/B comparisons, and the
//! simplest correct `Allocator` over any host-visible source.
//!
//! Alignment: a request aligned no more than the source's natural alignment is passed
//! through. A larger alignment over-allocates by `align` bytes and keeps the block's base
//! address in the 8 bytes just below the aligned pointer, so any power-of-two alignment
//! a `Layout` can express is honoured.

use core::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator, Layout};

use crate::error::{Error, Result};
use crate::source::HostVisible;
use crate::util::align_up;

/// An allocator that calls its source `S` once per allocation and once per free.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use cudalloc::{source::HostSource, Direct};
/// let mut v = Vec::new_in(Direct::new(HostSource));
/// v.extend_from_slice(&[1u8, 2, 3]);
/// assert_eq!(v, [1, 2, 3]);
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct Direct<S> {
    source: S,
}

impl<S> Direct<S> {
    /// An allocator over `source`.
    pub const fn new(source: S) -> Self {
        Self { source }
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.source
    }
}

const HEADER: usize = core::mem::size_of::<usize>();

impl<S: HostVisible> Direct<S> {
    /// Allocates a block for `layout`, saying why on failure.
    pub fn try_allocate(&self, layout: Layout) -> Result<NonNull<[u8]>> {
        self.tag().allocated(layout, self.allocate_block(layout))
    }

    /// This allocator's place in traces (one per memory kind).
    #[inline(always)]
    fn tag(&self) -> &'static crate::trace::Tag {
        crate::trace::direct(self.source.kind())
    }

    /// [`Direct::try_allocate`] without its trace hook.
    #[inline(always)]
    fn allocate_block(&self, layout: Layout) -> Result<NonNull<[u8]>> {
        if layout.size() == 0 {
            return Ok(crate::util::dangling_block(layout));
        }
        let natural = self.source.align();
        if layout.align() <= natural {
            let p = self.source.allocate(layout.size())?;
            return Ok(NonNull::slice_from_raw_parts(p, layout.size()));
        }
        // Over-aligned: the block is `size + align` bytes; the aligned pointer is at most
        // `align` past the base (the base is >= 16-aligned and the alignment larger), and
        // at least HEADER past it, leaving room to store the base.
        let total = layout.size().checked_add(layout.align()).ok_or(Error::TooLarge {
            requested: layout.size(),
            limit: usize::MAX - layout.align(),
        })?;
        let base = self.source.allocate(total)?;
        let addr = base.as_ptr() as usize;
        let aligned =
            align_up(addr + HEADER, layout.align()).ok_or(Error::InvalidArgument("address overflow"))?;
        let offset = aligned - addr;
        debug_assert!(
            (HEADER..=layout.align()).contains(&offset),
            "offset {offset} out of range for align {}",
            layout.align()
        );
        // SAFETY: base..base+total is ours; offset <= align, so aligned..aligned+size lies
        // within it, and the header word at aligned-HEADER >= base does too.
        unsafe {
            let p = base.as_ptr().add(offset);
            p.sub(HEADER).cast::<usize>().write_unaligned(addr);
            Ok(NonNull::slice_from_raw_parts(
                NonNull::new_unchecked(p),
                layout.size(),
            ))
        }
    }
}

// SAFETY: blocks are exclusive (the source's promise), of the layout's size and
// alignment (checked above), host-visible (S: HostVisible), and freed with the layout
// they were allocated with. Copies of a Direct share no state but the source, whose
// blocks any copy may free.
unsafe impl<S: HostVisible> Allocator for Direct<S> {
    #[inline]
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        self.try_allocate(layout).map_err(|e| {
            log::debug!("cudalloc: allocation of {layout:?} failed: {e}");
            AllocError
        })
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        self.tag().free(ptr.as_ptr(), layout.size(), true);
        if layout.align() <= self.source.align() {
            // SAFETY: allocated by try_allocate's pass-through branch with this size.
            return unsafe { self.source.deallocate(ptr, layout.size()) };
        }
        // SAFETY: allocated by the over-aligned branch, which stored the base address in
        // the word below `ptr`; the block is `size + align` bytes.
        unsafe {
            let base = ptr.as_ptr().sub(HEADER).cast::<usize>().read_unaligned();
            let base = ptr.with_addr(core::num::NonZeroUsize::new_unchecked(base));
            self.source.deallocate(base, layout.size() + layout.align())
        }
    }
}
