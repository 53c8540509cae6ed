//! Fresh host memory for registered pinned growth, with its pages faulted in by several
//! threads before `cuMemHostRegister` locks them: one thread faulting 1 GiB took most of
//! the 530 ms that the first `Vec::<u8, PinnedAlloc>::with_capacity_in(1 GiB)` cost on
//! the H200 machine. Page faults of one process scale over threads, as PyTorch's
//! `pinned_num_register_threads` relies on.
//!
//! On Unix a block is its own anonymous mapping (zeroed by the kernel), 2 MiB-aligned and
//! advised for transparent huge pages from 2 MiB, so a fault maps up to 2 MiB at once where
//! the system allows it; the prefault writes one byte per page. Elsewhere a block comes
//! from the system allocator and the prefault zeroes all of it.

use core::ptr::NonNull;

use crate::error::{Error, Result};
use crate::util::PAGE_SIZE;

/// Each prefault thread gets at least this much of a block: starting a thread costs tens
/// of microseconds, faulting 8 MiB a few milliseconds, so a thread more than this share
/// needs would cost more than it saves.
pub(crate) const BYTES_PER_THREAD: usize = 8 << 20;

/// A transparent huge page (x86-64, and aarch64 with 4 KiB pages): blocks of at least this
/// size are mapped aligned to it and advised for huge pages, and prefault runs are
/// multiples of it, so no huge page is faulted by two threads.
const HUGE_PAGE: usize = 2 << 20;

/// The most threads a prefault uses: `CUDALLOC_PREFAULT_THREADS` if set and valid (at
/// least 1), else the machine's available parallelism; read once per process.
pub(crate) fn max_threads() -> usize {
    use crate::sync::global::OnceLock;
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        crate::util::env_var("CUDALLOC_PREFAULT_THREADS", "a thread count of at least 1", |s| {
            s.trim().parse::<usize>().ok().filter(|&n| n > 0)
        })
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    })
}

/// Threads to fault `len` bytes in with when at most `max` may run: one per
/// [`BYTES_PER_THREAD`] started (rounded up), at least one, at most `max`.
pub(crate) fn threads_for(len: usize, max: usize) -> usize {
    len.div_ceil(BYTES_PER_THREAD).clamp(1, max.max(1))
}

/// Fresh, zeroed, page-aligned memory of `len` bytes (a multiple of the page), not yet
/// touched: a block of [`super::RegisteredSource`]. Free it with [`unmap`].
pub(crate) fn map(len: usize) -> Result<NonNull<u8>> {
    debug_assert!(len > 0 && len % PAGE_SIZE == 0, "{len} bytes");
    os::map(len)
}

/// Frees a block of [`map`].
///
/// # Safety
/// 1. `ptr` came from `map(len)` with this `len` and is not used after this call.
pub(crate) unsafe fn unmap(ptr: NonNull<u8>, len: usize) {
    // SAFETY: the caller's obligation 1.
    unsafe { os::unmap(ptr, len) }
}

/// Faults in the pages of a block of [`map`] with up to `max_threads` threads (see
/// [`threads_for`]), leaving its contents zero. A thread that cannot be started leaves its
/// run to the calling thread, so this never fails; returns the threads that took part
/// (the calling thread included).
///
/// # Safety
/// 1. `ptr..ptr + len` is a block of [`map`] (or any writable memory where `os::ZEROED`
///    is false) that nothing else reads or writes during the call.
pub(crate) unsafe fn prefault(ptr: NonNull<u8>, len: usize, max_threads: usize) -> usize {
    let threads = threads_for(len, max_threads);
    let block = Block {
        ptr,
        len,
        run: run_len(len, threads),
    };
    if threads == 1 {
        block.fault(0);
        return 1;
    }
    // Starting and joining threads allocates (their handles and result slots),
    // some of it freed by the threads as they exit: none of it is the caller's, so none of
    // it is counted, or a leak-checking `Counting` window open around a large pinned
    // allocation would report the blocks another thread freed.
    crate::count::uncounted(|| {
        let mut left_to_us = Vec::new();
        let mut started = Vec::new();
        // The calling thread takes the first run itself.
        for start in (block.run..len).step_by(block.run) {
            let run = SendBlock(block);
            // Unnamed: a name is copied on the new thread before the closure runs,
            // where it would still be counted.
            let spawned = std::thread::Builder::new().spawn(move || {
                crate::count::uncounted_thread();
                let run = run;
                run.0.fault(start)
            });
            match spawned {
                Ok(handle) => started.push(handle),
                Err(_) => left_to_us.push(start),
            }
        }
        block.fault(0);
        for start in left_to_us {
            block.fault(start);
        }
        let used = 1 + started.len();
        // Every thread is joined before the block is returned (a run cannot panic, and a
        // panicked thread is joined all the same): no thread outlives this call.
        for handle in started {
            let _ = handle.join();
        }
        used
    })
}

/// A copy of the block's description sent to one prefault thread, which `prefault` joins
/// before it returns.
struct SendBlock(Block);

// SAFETY: the block is memory the caller of `prefault` gave to that call alone; each
// thread writes only its own run of it (runs are disjoint), and `prefault` joins every
// thread before returning, so the block outlives every use.
unsafe impl Send for SendBlock {}

/// The length of each run of a block of `len` bytes cut for `threads` threads: whole pages
/// (whole huge pages from [`HUGE_PAGE`]), the last run taking the rest.
fn run_len(len: usize, threads: usize) -> usize {
    let granule = if len >= HUGE_PAGE { HUGE_PAGE } else { PAGE_SIZE };
    len.div_ceil(threads).div_ceil(granule).max(1) * granule
}

/// The block a prefault faults in, cut in runs of `run` bytes.
#[derive(Clone, Copy)]
struct Block {
    ptr: NonNull<u8>,
    len: usize,
    run: usize,
}

impl Block {
    /// Faults in the run starting at `start` (a multiple of `run` below `len`).
    fn fault(&self, start: usize) {
        debug_assert!(start < self.len && start % self.run == 0, "run at {start}");
        let end = start.saturating_add(self.run).min(self.len);
        // SAFETY: `start < end <= len`: one run of the block `prefault` was given (its
        // obligation 1); runs are disjoint and each is written by one thread only.
        unsafe {
            let run = self.ptr.as_ptr().add(start);
            if os::ZEROED {
                // The kernel zeroes the pages: one write per page maps it (a read would
                // map the shared zero page), and writing 0 keeps the contents.
                for offset in (0..end - start).step_by(PAGE_SIZE) {
                    run.add(offset).write_volatile(0);
                }
            } else {
                run.write_bytes(0, end - start);
            }
        }
    }
}

#[cfg(unix)]
mod os {
    use core::ptr::NonNull;

    use super::{Error, Result, HUGE_PAGE};

    /// Fresh anonymous mappings are zero.
    pub(super) const ZEROED: bool = true;

    pub(super) fn map(len: usize) -> Result<NonNull<u8>> {
        let huge = len >= HUGE_PAGE;
        // Room to align a block of huge pages to a huge page: the slop is unmapped below.
        let mapped = if huge {
            len.checked_add(HUGE_PAGE)
        } else {
            Some(len)
        };
        let mapped = mapped.ok_or(Error::OutOfMemory { requested: len })?;
        // SAFETY: an anonymous private mapping at an address the kernel picks: no memory
        // of ours is affected.
        let p = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED || p.is_null() {
            return Err(Error::OutOfMemory { requested: len });
        }
        let base = p.cast::<u8>();
        if !huge {
            // SAFETY: mmap succeeded, so `base` is not null.
            return Ok(unsafe { NonNull::new_unchecked(base) });
        }
        let head = (HUGE_PAGE - base as usize % HUGE_PAGE) % HUGE_PAGE;
        // SAFETY: `head <= HUGE_PAGE`, inside the mapping of `len + HUGE_PAGE` bytes; the
        // head and the tail are whole pages of the mapping, unused, and unmapped once.
        let start = unsafe {
            let start = base.add(head);
            if head > 0 {
                libc::munmap(base.cast(), head);
            }
            let tail = HUGE_PAGE - head;
            if tail > 0 {
                libc::munmap(start.add(len).cast(), tail);
            }
            // Advice only: where transparent huge pages are off, it fails or does nothing,
            // and the block is faulted in 4 KiB pages.
            #[cfg(any(target_os = "linux", target_os = "android"))]
            libc::madvise(start.cast(), len, libc::MADV_HUGEPAGE);
            start
        };
        // SAFETY: inside a successful mapping, so not null.
        Ok(unsafe { NonNull::new_unchecked(start) })
    }

    /// # Safety
    /// 1. `ptr` came from `map(len)` and is not used after this call.
    pub(super) unsafe fn unmap(ptr: NonNull<u8>, len: usize) {
        // SAFETY: `ptr..ptr+len` is exactly what `map` left mapped (obligation 1).
        if unsafe { libc::munmap(ptr.as_ptr().cast(), len) } != 0 {
            log::warn!("cudalloc: munmap of {len} bytes of registered memory failed");
        }
    }
}

#[cfg(not(unix))]
mod os {
    use core::ptr::NonNull;

    use super::Result;
    use crate::source::{HostSource, MemorySource};

    /// Memory from the system allocator may be reused: the prefault zeroes it.
    pub(super) const ZEROED: bool = false;

    pub(super) fn map(len: usize) -> Result<NonNull<u8>> {
        HostSource.allocate(len)
    }

    /// # Safety
    /// 1. `ptr` came from `map(len)` and is not used after this call.
    pub(super) unsafe fn unmap(ptr: NonNull<u8>, len: usize) {
        // SAFETY: `map` took it from HostSource with `len` (obligation 1).
        unsafe { HostSource.deallocate(ptr, len) }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn threads_are_sized_to_the_block_and_capped() {
        assert_eq!(threads_for(1, 16), 1, "a tiny block uses one thread");
        assert_eq!(threads_for(PAGE_SIZE, 16), 1);
        assert_eq!(threads_for(BYTES_PER_THREAD, 16), 1);
        assert_eq!(threads_for(BYTES_PER_THREAD + 1, 16), 2);
        assert_eq!(threads_for(64 << 20, 16), 8);
        assert_eq!(threads_for(1 << 30, 16), 16, "never more than the machine's");
        assert_eq!(threads_for(1 << 30, 1), 1);
        assert_eq!(threads_for(1 << 30, 0), 1, "at least one");
        assert!(max_threads() >= 1);
        // Runs cover the block in whole (huge) pages, one per thread at most.
        for (len, threads) in [
            (PAGE_SIZE, 1),
            (3 << 20, 1),
            ((24 << 20) + PAGE_SIZE, 4),
            (1 << 30, 16),
        ] {
            let run = run_len(len, threads);
            assert!(
                run * threads >= len && len.div_ceil(run) <= threads,
                "{len} / {threads}"
            );
            assert_eq!(run % PAGE_SIZE, 0);
        }
        assert_eq!(run_len(1 << 30, 16) % HUGE_PAGE, 0);
    }

    /// Maps a block of `len` bytes (a page multiple), prefaults it with up to `max`
    /// threads, and checks every byte is zero and writable afterwards.
    fn zero_and_writable_after(len: usize, max: usize) -> usize {
        let p = map(len).unwrap();
        assert_eq!(p.as_ptr() as usize % PAGE_SIZE, 0);
        // SAFETY: `p` is a fresh block of `len` bytes, ours until unmapped below.
        let (used, bytes) = unsafe {
            let used = prefault(p, len, max);
            (used, core::slice::from_raw_parts_mut(p.as_ptr(), len))
        };
        let bad = bytes.iter().position(|&b| b != 0);
        assert_eq!(bad, None, "{len} bytes with {used} threads: a byte not zero");
        bytes.fill(3);
        assert!(bytes.iter().all(|&b| b == 3), "writable after the prefault");
        // SAFETY: mapped above with `len`; no thread touches it any more.
        unsafe { unmap(p, len) };
        used
    }

    #[test]
    fn a_threaded_prefault_leaves_odd_sizes_zero_and_writable() {
        // Sizes that are not multiples of a thread's share or of the huge page, so the
        // last run is short (sizes reach the source rounded up to the page).
        for len in [
            BYTES_PER_THREAD + PAGE_SIZE,
            3 * BYTES_PER_THREAD + 5 * PAGE_SIZE,
            5 * BYTES_PER_THREAD - PAGE_SIZE,
        ] {
            let used = zero_and_writable_after(len, 4);
            assert_eq!(used, threads_for(len, 4), "{len} bytes");
            assert!(used > 1, "{len} bytes: more than one thread");
        }
    }

    #[test]
    fn tiny_blocks_are_faulted_by_one_thread() {
        for len in [PAGE_SIZE, 3 * PAGE_SIZE, 2 << 20, BYTES_PER_THREAD] {
            assert_eq!(zero_and_writable_after(len, 8), 1, "{len} bytes");
        }
    }

    #[test]
    fn more_threads_than_the_pages_need_are_never_started() {
        // With a cap above what the block needs, the block's size decides.
        assert_eq!(zero_and_writable_after(2 * BYTES_PER_THREAD, 64), 2);
    }

    #[test]
    fn memory_that_was_written_before_is_zero_after_the_prefault() {
        // Unmapped memory is never handed out again unzeroed: map, dirty, unmap, map the
        // same size again (the kernel may give the same pages back).
        let len = 3 * BYTES_PER_THREAD;
        let p = map(len).unwrap();
        // SAFETY: a fresh block of `len` bytes, unmapped right after.
        unsafe {
            p.as_ptr().write_bytes(0xA5, len);
            unmap(p, len);
        }
        assert!(zero_and_writable_after(len, 3) > 1);
    }
}
