//! The table of allocation sites: an entry per live block recorded in a window, with
//! (feature `backtrace`) its raw stack, resolved to names only when a report asks.
//!
//! This code runs inside the allocator, perhaps the global one, so:
//! - capture (feature `backtrace`) unwinds into a fixed array with the `backtrace` crate's unsynchronized
//!   walker: it takes no lock of std's and allocates nothing. (std's `Backtrace` takes a
//!   process-wide lock and allocates under it: a thread capturing one re-enters the
//!   allocator holding that lock, and deadlocked when site capture took it again.)
//! - the table lives in memory from `System` directly, behind a std `Mutex` (which does
//!   not allocate); nothing under the lock allocates through the global allocator,
//!   captures or resolves, so a thread never waits on the lock while holding it.
//! - a thread-local state keeps site code from recursing: while a thread captures, what
//!   it allocates is counted but never recorded; while it resolves and formats a report
//!   it is internal: what it allocates then (the crate's own memory, such as the symbol
//!   cache) is neither counted nor recorded, nor counted when freed under the flag.

use core::cell::Cell;
#[cfg(feature = "backtrace")]
use core::ffi::c_void;
#[cfg(feature = "backtrace")]
use core::fmt::Write as _;
use core::hash::{BuildHasher, Hasher};
use std::alloc::System;

use allocator_api2::vec::Vec as SysVec;
use hashbrown::HashMap;

use super::{LeakSite, SiteKey};
use crate::count::thread::set_site_busy;
use crate::sync::global::{AtomicU64, AtomicUsize, Ordering};
use crate::sync::{lock, Mutex};

pub(crate) const ENABLED: bool = true;

/// Return addresses kept per block: the allocator's own frames (about ten) and enough
/// of the caller's to find the leak; none without the `backtrace` feature.
const FRAMES: usize = if cfg!(feature = "backtrace") { 64 } else { 0 };

struct Entry {
    size: usize,
    key: SiteKey,
    /// `frames[..depth]` are return addresses, innermost first.
    frames: [usize; FRAMES],
    depth: usize,
}

/// Live sites by (allocator id, address): two `Counting`s may hand out the same address
/// (one may count blocks carved from memory the other handed out).
type Table = HashMap<(usize, usize), Entry, AddressHasher, System>;

/// Shards of the table, by address: threads counting in windows at once take different
/// locks (one table behind one lock cost 8 threads with windows open about 10 us a pair
/// on the H200 machine).
const SHARDS: usize = 64;
static TABLES: [Mutex<Table>; SHARDS] =
    [const { Mutex::new(HashMap::with_hasher_in(AddressHasher, System)) }; SHARDS];
/// Entries in all shards, changed under the shard's lock: lets frees skip the locks when
/// nothing is recorded. A block's entry is in the table from before its address is handed
/// to the caller until it is freed, so while it is live the count is nonzero.
static RECORDED: AtomicUsize = AtomicUsize::new(0);

/// The shard holding the entries of blocks at `addr`.
fn shard(addr: usize) -> &'static Mutex<Table> {
    let h = ((addr >> 4) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58;
    &TABLES[h as usize % SHARDS]
}
/// Allocation order; windows keep the sites recorded since they opened.
static SEQ: AtomicU64 = AtomicU64::new(0);

/// What site code is doing on this thread.
#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    /// Capturing a stack: allocations are counted, not recorded.
    Capturing,
    /// Building a report: allocations and their frees are neither counted nor recorded.
    Internal,
    /// The crate's own bookkeeping (a pool's thread cache made on first use, its lists'
    /// growth): allocations and reallocations are counted in the allocator's totals, as
    /// every block is, but neither in this thread's windows nor recorded, because they
    /// outlive the windows by design. Frees count in windows as ever.
    Bookkeeping,
}

thread_local! {
    static STATE: Cell<State> = const { Cell::new(State::Idle) };
}

/// Whether this thread is building a report, so that what it allocates or frees now is
/// the crate's own and must not be counted.
#[inline(always)]
pub(crate) fn is_internal() -> bool {
    STATE.try_with(|s| s.get() == State::Internal).unwrap_or(false)
}

/// Whether this thread is in the crate's bookkeeping ([`bookkeeping`]), so that what it
/// allocates or frees now stays out of its windows.
#[inline(always)]
pub(crate) fn is_bookkeeping() -> bool {
    STATE.try_with(|s| s.get() == State::Bookkeeping).unwrap_or(false)
}

/// Runs `f` as the crate's bookkeeping: what this thread allocates (or grows by
/// reallocation) meanwhile is counted in every `Counting`'s totals but not in this
/// thread's windows, and no site is recorded for it; frees count as ever (a block the
/// window allocated may be freed here: a buffer's record of its uses, which the pool
/// frees in its slow path). For the metadata a pool keeps beyond the call that made it
/// (a thread's cache, made on the thread's first use of the pool and freed when the
/// thread exits; the pool's lists), which a leak check of the user's code must not
/// report. A block allocated here and freed in a window counts there as a free without
/// an allocation, which no verdict reports.
pub(crate) fn bookkeeping<R>(f: impl FnOnce() -> R) -> R {
    let _bookkeeping = Enter::from_idle(State::Bookkeeping);
    f()
}

/// This thread's state set to another for as long as the guard lives.
struct Enter(State);

impl Enter {
    /// Enters `state` if the thread is idle; `None` if it is already in site code (or
    /// its thread-locals are gone).
    fn from_idle(state: State) -> Option<Enter> {
        Self::from(&[State::Idle], state)
    }

    /// Enters `state` if the thread is in one of the states `from`; `None` otherwise.
    fn from(from: &[State], state: State) -> Option<Enter> {
        STATE
            .try_with(|s| from.contains(&s.get()).then(|| Enter(s.replace(state))))
            .ok()
            .flatten()
            .inspect(|_| set_site_busy(true))
    }
}

impl Drop for Enter {
    fn drop(&mut self) {
        let _ = STATE.try_with(|s| s.set(self.0));
        set_site_busy(self.0 != State::Idle);
    }
}

/// Runs `f` with this thread's allocations and frees neither counted nor recorded (as
/// while a report is built): for the crate's own short-lived helper work, such as the
/// prefault threads it starts and joins inside an allocation.
pub(crate) fn uncounted<R>(f: impl FnOnce() -> R) -> R {
    // From bookkeeping too (a pool's slow path that starts prefault threads): what the
    // threads free is not counted, so what starting them allocates must not be either.
    let _internal = Enter::from(&[State::Idle, State::Bookkeeping], State::Internal);
    f()
}

/// Leaves this thread's allocations and frees uncounted for the rest of its life (its
/// exit included): for a helper thread whose start-up blocks an [`uncounted`] caller
/// allocated and which it frees on its way out.
pub(crate) fn uncounted_thread() {
    let _ = STATE.try_with(|s| s.set(State::Internal));
    set_site_busy(true);
}

/// The position in allocation order now.
pub(crate) fn now() -> u64 {
    SEQ.load(Ordering::Relaxed)
}

/// Records where the block at `addr` of `instance` is being allocated, on the thread
/// with serial `thread`.
#[cold]
#[inline(never)]
pub(crate) fn record(thread: u64, instance: usize, addr: usize, size: usize) {
    let Some(_capturing) = Enter::from_idle(State::Capturing) else {
        return;
    };
    let mut frames = [0; FRAMES];
    let depth = capture(&mut frames);
    let key = SiteKey {
        thread,
        instance,
        seq: SEQ.fetch_add(1, Ordering::Relaxed),
    };
    insert(
        (instance, addr),
        Entry {
            size,
            key,
            frames,
            depth,
        },
    );
}

/// Without the `backtrace` feature no stack is kept.
#[cfg(not(feature = "backtrace"))]
fn capture(_frames: &mut [usize; FRAMES]) -> usize {
    0
}

/// Fills `frames` with the return addresses of the calling stack, innermost first;
/// returns how many it wrote.
#[cfg(feature = "backtrace")]
fn capture(frames: &mut [usize; FRAMES]) -> usize {
    crate::util::capture_stack(frames)
}

fn insert(key: (usize, usize), entry: Entry) {
    let mut table = lock(shard(key.1));
    // With no memory for the table the block goes unrecorded: no abort in an allocator.
    if table.try_reserve(1).is_ok() && table.insert(key, entry).is_none() {
        RECORDED.fetch_add(1, Ordering::Relaxed);
    }
}

#[cold]
#[inline(never)]
fn remove(instance: usize, addr: usize) -> Option<Entry> {
    let mut table = lock(shard(addr));
    let entry = table.remove(&(instance, addr));
    if entry.is_some() {
        RECORDED.fetch_sub(1, Ordering::Relaxed);
    }
    entry
}

/// Forgets the block at `addr` of the allocator whose id `instance` gives (0: an
/// allocator that never recorded), which is being freed.
#[inline(always)]
pub(crate) fn forget(instance: impl FnOnce() -> usize, addr: usize) {
    if RECORDED.load(Ordering::Relaxed) != 0 {
        let instance = instance();
        if instance != 0 {
            remove(instance, addr);
        }
    }
}

/// The site of a block being reallocated, out of the table while the block moves: once
/// the inner allocator has the old address back, another thread may be handed it (and
/// record it) at once.
pub(crate) struct Detached(Option<(usize, Entry)>);

/// Takes the site of the block at `addr` of the allocator whose id `instance` gives
/// out of the table, if it has one (see [`forget`]).
#[inline(always)]
pub(crate) fn detach(instance: impl FnOnce() -> usize, addr: usize) -> Detached {
    if RECORDED.load(Ordering::Relaxed) == 0 {
        return Detached::none();
    }
    let instance = instance();
    if instance == 0 {
        return Detached::none();
    }
    Detached(remove(instance, addr).map(|entry| (instance, entry)))
}

impl Detached {
    /// No site to carry over.
    #[inline(always)]
    pub(crate) fn none() -> Self {
        Detached(None)
    }

    /// Puts the site back for the block now at `addr` with `size` bytes (where it moved,
    /// or where it stayed if the reallocation failed). A block that had no site gets
    /// none: it was allocated outside every window, so no window's leak.
    #[inline(always)]
    pub(crate) fn reattach(self, addr: usize, size: usize) {
        if let Some((instance, mut entry)) = self.0 {
            entry.size = size;
            insert((instance, addr), entry);
        }
    }
}

/// A recorded site copied out of the table, to resolve outside its lock.
#[cfg_attr(not(feature = "backtrace"), allow(dead_code))]
struct Found {
    seq: u64,
    address: usize,
    size: usize,
    frames: [usize; FRAMES],
    depth: usize,
}

/// Whether any recorded block is one that `keep` selects (copies and allocates nothing).
pub(crate) fn any(keep: impl Fn(&SiteKey) -> bool) -> bool {
    let Some(_internal) = Enter::from_idle(State::Internal) else {
        return false;
    };
    TABLES
        .iter()
        .any(|table| lock(table).iter().any(|(_, e)| keep(&e.key)))
}

/// The sites of recorded blocks that `keep` selects, oldest first.
pub(crate) fn collect(keep: impl Fn(&SiteKey) -> bool) -> Vec<LeakSite> {
    let Some(internal) = Enter::from_idle(State::Internal) else {
        return Vec::new();
    };
    let mut found: SysVec<Found, System> = SysVec::new_in(System);
    for table in &TABLES {
        let table = lock(table);
        for (&(_, address), e) in table.iter().filter(|(_, e)| keep(&e.key)) {
            if found.try_reserve(1).is_err() {
                break;
            }
            found.push(Found {
                seq: e.key.seq,
                address,
                size: e.size,
                frames: e.frames,
                depth: e.depth,
            });
        }
    }
    found.sort_unstable_by_key(|f| f.seq);
    let mut texts: SysVec<(usize, usize, SysText), System> = SysVec::new_in(System);
    if texts.try_reserve_exact(found.len()).is_ok() {
        for f in &found {
            #[cfg_attr(not(feature = "backtrace"), allow(unused_mut))]
            let mut text = SysText(SysVec::new_in(System));
            #[cfg(feature = "backtrace")]
            resolve(&f.frames[..f.depth], &mut text);
            texts.push((f.address, f.size, text));
        }
    }
    drop(found);
    drop(internal);
    // Now counted like any other allocation of the caller's: the report is theirs.
    texts
        .iter()
        .map(|(address, size, text)| LeakSite {
            address: *address,
            size: *size,
            backtrace: trim(&String::from_utf8_lossy(&text.0)).to_owned(),
        })
        .collect()
}

/// Writes the frames at `ips` as std prints a backtrace: a numbered line per function
/// (inlined ones included) and its source location.
#[cfg(feature = "backtrace")]
fn resolve(ips: &[usize], out: &mut SysText) {
    let mut i = 0;
    for &ip in ips {
        let mut named = false;
        backtrace::resolve(ip as *mut c_void, |symbol| {
            named = true;
            i += 1;
            let _ = match symbol.name() {
                Some(name) => writeln!(out, "{i:4}: {name:#}"),
                None => writeln!(out, "{i:4}: <unknown>"),
            };
            if let (Some(file), Some(line)) = (symbol.filename(), symbol.lineno()) {
                let _ = match symbol.colno() {
                    Some(col) => writeln!(out, "             at {}:{line}:{col}", file.display()),
                    None => writeln!(out, "             at {}:{line}", file.display()),
                };
            }
        });
        if !named {
            i += 1;
            let _ = writeln!(out, "{i:4}: <unknown> ({ip:#x})");
        }
    }
}

/// The frames worth showing: those below the last frame of the allocator (the capture,
/// `Counting`, the allocation shims), down to, not including, the thread's start-up
/// below `__rust_begin_short_backtrace`, as std's short backtraces do.
fn trim(text: &str) -> &str {
    let mut start = 0;
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        at += line.len();
        if frame_name(line).is_some_and(is_allocator_frame) {
            start = at;
        }
    }
    // Skip the last allocator frame's location line.
    let rest = &text[start..];
    let first_frame = rest
        .split_inclusive('\n')
        .take_while(|line| frame_name(line).is_none())
        .map(str::len)
        .sum::<usize>();
    let rest = &rest[first_frame..];
    let mut end = rest.len();
    let mut at = 0;
    for line in rest.split_inclusive('\n') {
        if frame_name(line).is_some_and(|name| name.contains("__rust_begin_short_backtrace")) {
            end = at;
            break;
        }
        at += line.len();
    }
    rest[..end].trim_end()
}

/// The function named on a frame line (`"  12: name"`); `None` on a location line.
fn frame_name(line: &str) -> Option<&str> {
    let (number, name) = line.trim_start().split_once(": ")?;
    (!number.is_empty() && number.bytes().all(|b| b.is_ascii_digit())).then(|| name.trim_end())
}

/// Whether a function belongs to the allocator's side of a captured stack. The window
/// API (`count::window`) is not: it calls the user's code, so its frames lie below the
/// allocation, with the user's.
fn is_allocator_frame(name: &str) -> bool {
    (name.contains("cudalloc::count::") && !name.contains("cudalloc::count::window::"))
        || crate::util::is_walker_or_shim_frame(name)
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

/// Hashes the (allocator, address) keys: a folded multiply per word, as foldhash does,
/// so aligned addresses (low bits zero) still spread over the buckets. Keys are
/// addresses, not input an attacker chooses, so no random seed is needed.
#[derive(Clone, Copy, Default)]
struct AddressHasher;

impl BuildHasher for AddressHasher {
    type Hasher = AddressHash;
    fn build_hasher(&self) -> AddressHash {
        AddressHash(0)
    }
}

struct AddressHash(u64);

impl AddressHash {
    fn mix(&mut self, word: u64) {
        let product = u128::from(self.0 ^ word) * 0x9E37_79B9_7F4A_7C15;
        self.0 = (product as u64) ^ ((product >> 64) as u64);
    }
}

impl Hasher for AddressHash {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.mix(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trim_keeps_the_callers_frames() {
        let text = "   1: backtrace::backtrace::libunwind::trace\n\
                    \x20            at /x/libunwind.rs:1:1\n   \
                    2: cudalloc::count::sites::table::record\n   \
                    3: std::thread::local::LocalKey<T>::try_with\n   \
                    4: cudalloc::count::Counting<A>::count_alloc\n   \
                    5: <cudalloc::count::Counting<A> as core::alloc::global::GlobalAlloc>::alloc\n   \
                    6: __rustc::__rust_alloc\n\
                    \x20            at /x/app.rs:1:1\n   \
                    7: alloc::raw_vec::RawVec<T>::grow_one\n\
                    \x20            at /rust/raw_vec.rs:5:5\n   \
                    8: app::leaky\n   \
                    9: cudalloc::count::window::check_leaks_on_this_thread\n  \
                    10: std::sys::backtrace::__rust_begin_short_backtrace\n  \
                    11: std::rt::lang_start\n";
        let kept = trim(text);
        assert!(kept.starts_with("   7: alloc::raw_vec"), "{kept}");
        // The leak helper that ran the caller's code is the caller's side.
        assert!(
            kept.ends_with("9: cudalloc::count::window::check_leaks_on_this_thread"),
            "{kept}"
        );
        // Nothing recognizable: everything is shown.
        assert_eq!(trim("   1: a\n   2: b\n"), "   1: a\n   2: b");
    }

    #[test]
    fn hash_spreads_aligned_addresses() {
        let hash = |a: usize| AddressHasher.hash_one((1usize, a));
        let low_bits: std::collections::HashSet<u64> =
            (0..64).map(|i| hash(0x7f00_0000_0000 + i * 4096) & 63).collect();
        assert!(low_bits.len() > 32, "{} of 64 buckets", low_bits.len());
    }
}
