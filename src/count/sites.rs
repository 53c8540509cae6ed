//! Allocation sites (feature `backtrace`): the stack of every block allocated while a
//! window is open, kept until the block is freed, so a leak report can say where each
//! leaked block came from.
//!
//! Capturing a `Backtrace` allocates, and this code runs inside the allocator (perhaps
//! the global one). So: the table lives in memory from `std::alloc::System` directly;
//! while the crate captures, formats or drops a backtrace it sets the thread's
//! `internal` flag, and `Counting` neither counts nor records what is allocated or
//! freed under it (such blocks are also freed under it); and nothing is captured while
//! the thread is panicking. Backtraces are captured and formatted outside the table's
//! lock. One hazard remains: std serializes backtraces with a lock of its own, so code
//! that captures or prints a std `Backtrace` inside a window on a thread whose global
//! allocator is `Counting` deadlocks.

use core::fmt::Write as _;
use std::alloc::System;
use std::backtrace::Backtrace;

use allocator_api2::vec::Vec as SysVec;

use super::thread::ThreadState;
use super::LeakSite;
use crate::sync::global::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use crate::sync::{Arc, UnsafeCell};

pub(crate) const ENABLED: bool = true;

/// What a window filters the table by.
pub(crate) struct SiteKey {
    pub(crate) thread: u64,
    pub(crate) instance: usize,
    pub(crate) seq: u64,
}

struct Entry {
    addr: usize,
    size: usize,
    key: SiteKey,
    site: Arc<Backtrace>,
}

/// Open addressing with linear probing over `slots` (a power of two long, or empty);
/// `len <= slots.len() / 2`.
struct Table {
    slots: SysVec<Option<Entry>, System>,
    len: usize,
}

/// Number of entries in the table: lets frees skip the lock when nothing is recorded.
static RECORDED: AtomicUsize = AtomicUsize::new(0);
/// Allocation order; windows keep the sites recorded since they opened.
static SEQ: AtomicU64 = AtomicU64::new(0);
static TABLE: SpinLock<Table> = SpinLock::new(Table {
    slots: SysVec::new_in(System),
    len: 0,
});

/// The position in allocation order now.
pub(crate) fn now() -> u64 {
    SEQ.load(Ordering::Relaxed)
}

/// Records where the block at `addr` is being allocated.
#[cold]
#[inline(never)]
pub(crate) fn record(t: &ThreadState, instance: usize, addr: usize, size: usize) {
    if std::thread::panicking() {
        return;
    }
    let outer = t.set_internal(true);
    let site = Arc::new(Backtrace::force_capture());
    let key = SiteKey {
        thread: t.serial(),
        instance,
        seq: SEQ.fetch_add(1, Ordering::Relaxed),
    };
    let displaced = TABLE.with(|table| {
        table.insert(Entry {
            addr,
            size,
            key,
            site,
        })
    });
    drop(displaced); // outside the lock, still internal
    t.set_internal(outer);
}

/// Forgets the block at `addr`, which is being freed or moved.
#[inline]
pub(crate) fn forget(t: &ThreadState, addr: usize) {
    if RECORDED.load(Ordering::Relaxed) != 0 {
        forget_recorded(t, addr);
    }
}

#[cold]
#[inline(never)]
fn forget_recorded(t: &ThreadState, addr: usize) {
    if let Some(entry) = TABLE.with(|table| table.remove(addr)) {
        let outer = t.set_internal(true);
        drop(entry);
        t.set_internal(outer);
    }
}

/// The sites of recorded blocks that `keep` selects, oldest first.
pub(crate) fn collect(t: &ThreadState, keep: impl Fn(&SiteKey) -> bool) -> Vec<LeakSite> {
    let outer = t.set_internal(true);
    let mut found: SysVec<(u64, usize, usize, Arc<Backtrace>), System> = SysVec::new_in(System);
    TABLE.with(|table| {
        for e in table.slots.iter().flatten().filter(|e| keep(&e.key)) {
            if found.try_reserve(1).is_ok() {
                found.push((e.key.seq, e.addr, e.size, e.site.clone()));
            }
        }
    });
    found.sort_unstable_by_key(|f| f.0);
    let mut texts: SysVec<(usize, usize, SysVec<u8, System>), System> = SysVec::new_in(System);
    for (_, addr, size, site) in found.drain(..) {
        let mut text = SysText(SysVec::new_in(System));
        let _ = write!(text, "{site}");
        if texts.try_reserve(1).is_ok() {
            texts.push((addr, size, text.0));
        }
    }
    drop(found);
    t.set_internal(outer);
    // Now counted like any other allocation of the caller's.
    texts
        .iter()
        .map(|(address, size, text)| LeakSite {
            address: *address,
            size: *size,
            backtrace: trim(&String::from_utf8_lossy(text)),
        })
        .collect()
}

/// Drops the frames of the capture and of the allocator itself (everything up to the
/// last frame in `cudalloc::count` or in the allocation shims), and those of the thread
/// start-up below `__rust_begin_short_backtrace`, as std's short backtraces do.
fn trim(text: &str) -> String {
    let frames: Vec<&str> = text.split_inclusive('\n').collect();
    let is_frame_start = |l: &str| {
        let l = l.trim_start();
        l.split_once(": ")
            .is_some_and(|(n, _)| n.chars().all(|c| c.is_ascii_digit()))
    };
    let internal = |l: &str| {
        l.contains("cudalloc::count::")
            || l.contains("std::backtrace")
            || l.contains("__rust_alloc")
            || l.contains("__rust_realloc")
            || l.contains("__rg_alloc")
            || l.contains("__rg_realloc")
    };
    let start = frames
        .iter()
        .rposition(|l| is_frame_start(l) && internal(l))
        .map(|i| {
            // Skip that frame's `at file:line` lines too.
            let mut j = i + 1;
            while j < frames.len() && !is_frame_start(frames[j]) {
                j += 1;
            }
            j
        })
        .unwrap_or(0);
    let end = frames
        .iter()
        .position(|l| is_frame_start(l) && l.contains("__rust_begin_short_backtrace"))
        .filter(|&end| end > start)
        .unwrap_or(frames.len());
    frames[start..end].concat().trim_end().to_owned()
}

/// `fmt::Write` into memory from `System`; stops quietly when memory runs out.
struct SysText(SysVec<u8, System>);

impl core::fmt::Write for SysText {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        if self.0.try_reserve(s.len()).is_ok() {
            self.0.extend_from_slice(s.as_bytes());
        }
        Ok(())
    }
}

impl Table {
    fn home(&self, addr: usize) -> usize {
        let h = (addr as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h >> 32) as usize & (self.slots.len() - 1)
    }

    /// Inserts `entry`, returning what it displaced (a stale entry at the same address)
    /// or, when there is no memory to grow the table, `entry` itself.
    fn insert(&mut self, entry: Entry) -> Option<Entry> {
        if (self.len + 1) * 2 > self.slots.len() && !self.grow() {
            return Some(entry);
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(entry.addr);
        loop {
            match &self.slots[i] {
                Some(e) if e.addr == entry.addr => return self.slots[i].replace(entry),
                Some(_) => i = (i + 1) & mask,
                None => {
                    self.slots[i] = Some(entry);
                    self.len += 1;
                    RECORDED.store(self.len, Ordering::Relaxed);
                    return None;
                }
            }
        }
    }

    fn remove(&mut self, addr: usize) -> Option<Entry> {
        if self.len == 0 {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(addr);
        loop {
            match &self.slots[i] {
                Some(e) if e.addr == addr => break,
                Some(_) => i = (i + 1) & mask,
                None => return None,
            }
        }
        let removed = self.slots[i].take();
        self.len -= 1;
        RECORDED.store(self.len, Ordering::Relaxed);
        // Backward-shift deletion: move later entries of the probe run into the hole
        // unless their home lies cyclically in (hole, position].
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let Some(e) = &self.slots[j] else { break };
            let home = self.home(e.addr);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = self.slots[j].take();
                hole = j;
            }
        }
        removed
    }

    fn grow(&mut self) -> bool {
        let cap = (self.slots.len() * 2).max(64);
        let mut slots = SysVec::new_in(System);
        if slots.try_reserve_exact(cap).is_err() {
            return false;
        }
        slots.resize_with(cap, || None);
        let old = core::mem::replace(&mut self.slots, slots);
        self.len = 0;
        for entry in old.into_iter().flatten() {
            self.insert(entry);
        }
        true
    }
}

/// A lock that never allocates (the table is used from inside the allocator); held only
/// for table operations, never while capturing or formatting.
struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through `with`, which holds the lock, so at most
// one thread at a time has it; `T: Send` lets it move between the threads taking turns.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    const fn new(value: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
        struct Unlock<'a>(&'a AtomicBool);
        impl Drop for Unlock<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _unlock = Unlock(&self.locked);
        // SAFETY: the lock is held until `_unlock` drops, after `f` returns, so this is
        // the only reference to the value.
        self.value.with_mut(|p| f(unsafe { &mut *p }))
    }
}
