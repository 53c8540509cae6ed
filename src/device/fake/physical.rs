//! Simulated physical memory for the page heap (`FakePhys`): every handle, range,
//! mapping and use is booked, and every breach of the VMM rules or of stream order is
//! counted (see the type's docs).

use std::collections::BTreeMap;
use std::time::Duration;

use super::FakeStream;
use crate::device::phys::Phys;
use crate::error::{Error, Result};
use crate::sync::{lock, Arc, Mutex};

/// Simulated physical memory for the page heap, checking every operation: handles
/// are multiples of the granule (a chunk's, or a group's of several chunks), mapped
/// whole into reserved ranges at unmapped places (never at an offset), unmapped only as
/// the whole mapping one map made, released only when unmapped, ranges freed only when
/// empty; access set only over whole mappings; a
/// block's use ([`FakePhys::use_block`]) needs access set and a stream ordered after
/// every earlier use of each handle under it (on any range); an unmapping needs every
/// use of that mapping completed. Breaches are counted in `violations` (and printed),
/// never panics: tests assert there are none. Clones share the state. Failures can be
/// injected ([`FakePhys::fail_next`]): the next calls of an operation then fail, changing
/// nothing.
#[derive(Clone, Debug)]
pub(crate) struct FakePhys {
    pub(crate) state: Arc<Mutex<PhysState>>,
    /// Called at the start of every operation, before the books are locked
    /// ([`FakePhys::with_hook`]).
    hook: Option<Hook>,
    /// What each operation takes, slept before it ([`FakePhys::with_costs`]).
    costs: Option<DriverCosts>,
}

/// What the simulated physical memory's operations take, as a GPU's driver would: each
/// operation sleeps its cost (at least: the sleep may overshoot) before it runs, with no
/// lock of its own held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverCosts {
    /// `cuMemCreate`.
    pub create: Duration,
    /// `cuMemMap`.
    pub map: Duration,
    /// `cuMemSetAccess` (one mapping).
    pub access: Duration,
    /// `cuMemUnmap`.
    pub unmap: Duration,
    /// `cuMemRelease`.
    pub release: Duration,
}

impl DriverCosts {
    /// The costs measured on an H100 80GB HBM3 with driver 580 (`tools/vmm_costs.c`,
    /// BENCHMARKS.md, 2026-12-05): create 17 us, map 1 us, access 33 us, unmap 34 us
    /// (the H200's figure), release 10 us.
    pub const H100: Self = Self {
        create: Duration::from_micros(17),
        map: Duration::from_micros(1),
        access: Duration::from_micros(33),
        unmap: Duration::from_micros(34),
        release: Duration::from_micros(10),
    };

    fn of(&self, op: PhysOp) -> Duration {
        match op {
            PhysOp::Create => self.create,
            PhysOp::Map => self.map,
            PhysOp::SetAccess => self.access,
            PhysOp::Unmap => self.unmap,
            PhysOp::Release => self.release,
            PhysOp::Reserve | PhysOp::FreeRange => Duration::ZERO,
        }
    }
}

/// A function called with each operation of a [`FakePhys`] as it begins.
#[derive(Clone)]
struct Hook(crate::sync::global::Arc<dyn Fn(PhysOp) + Send + Sync>);

impl core::fmt::Debug for Hook {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Hook")
    }
}

/// A mapping: bytes, handle, the devices with access (bit d: device d; the fake's own
/// device is 0), uses through it, its id (one per `map`).
pub(crate) type Mapping = (usize, u64, u64, Vec<(FakeStream, u64)>, u64);

/// The simulated physical memory's books.
#[derive(Debug, Default)]
pub(crate) struct PhysState {
    pub(crate) granule: usize,
    /// Bytes of handles that may exist at once (out of memory beyond).
    pub(crate) limit: usize,
    next_handle: u64,
    next_va: u64,
    /// Live handles: bytes, mappings.
    pub(crate) handles: BTreeMap<u64, (usize, u32)>,
    pub(crate) handle_bytes: usize,
    /// Reserved ranges: start -> bytes.
    pub(crate) ranges: BTreeMap<u64, usize>,
    /// Mappings by start.
    pub(crate) mappings: BTreeMap<u64, Mapping>,
    /// Uses of each handle, through any mapping (by id), not known to have completed.
    uses: BTreeMap<u64, Vec<(u64, FakeStream, u64)>>,
    next_mapping: u64,
    pub(crate) violations: Vec<String>,
    /// Per handle, what happened to it (for the violations' messages).
    history: BTreeMap<u64, Vec<String>>,
    pub(crate) creates: u64,
    pub(crate) maps: u64,
    /// Injected failures: how many of the next calls of each operation fail.
    fail: BTreeMap<PhysOp, u32>,
}

/// An operation of [`FakePhys`] that can be made to fail ([`FakePhys::fail_next`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum PhysOp {
    Create,
    Map,
    Unmap,
    SetAccess,
    Release,
    Reserve,
    FreeRange,
}

impl PhysState {
    /// Whether this call of `op` is to fail (an injected failure, used up).
    fn fails(&mut self, op: PhysOp) -> bool {
        match self.fail.get_mut(&op) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }

    fn violation(&mut self, what: String) {
        eprintln!("fake phys: {what}");
        self.violations.push(what);
    }

    /// The starts of the mappings overlapping `va..end` (the first may start before it).
    fn mappings_over(&self, va: u64, end: u64) -> Vec<u64> {
        self.mappings
            .range(..end)
            .rev()
            .take_while(|(&v, m)| v + m.0 as u64 > va)
            .map(|(&v, _)| v)
            .collect()
    }

    /// Books the use at `pos` of `stream` through the mapping at `v`, of the part there of
    /// the block `va..end`: checks access and (with `check`) that `stream` is ordered after
    /// the uses of the mapping's handle through other mappings. The bytes of the block the
    /// mapping covers, and the breaches found.
    fn book_use(
        &mut self,
        v: u64,
        (va, end): (u64, u64),
        stream: &FakeStream,
        pos: u64,
        check: bool,
    ) -> (usize, Vec<String>) {
        let mut problems = Vec::new();
        let m = self.mappings.get_mut(&v).expect("found");
        let covered = (v + m.0 as u64).min(end).saturating_sub(v.max(va)) as usize;
        if m.2 & 1 == 0 {
            problems.push(format!("use of {v:#x} without access"));
        }
        m.3.push((stream.clone(), pos));
        let (h, id) = (m.1, m.4);
        let uses = self.uses.entry(h).or_default();
        uses.retain(|(_, s, p)| s.completed() < *p);
        for (_, s, p) in uses.iter().filter(|u| check && u.0 != id) {
            if !stream.covers(s, *p) {
                let h_ = self
                    .history
                    .get(&h)
                    .map(|v| v[v.len().saturating_sub(12)..].to_vec());
                problems.push(format!(
                    "handle {h} used on {} at {pos} unordered after its use on {} at {p} \
                     ({} completed); history {h_:?}",
                    stream.id(),
                    s.id(),
                    s.completed()
                ));
            }
        }
        uses.push((id, stream.clone(), pos));
        self.history
            .entry(h)
            .or_default()
            .push(format!("use of map {id} on {} at {pos}", stream.id()));
        (covered, problems)
    }
}

/// The error of an injected failure.
const INJECTED: Error = Error::InvalidArgument("fake phys: injected failure");

impl FakePhys {
    pub(crate) fn new(granule: usize, limit: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(PhysState {
                granule,
                limit,
                next_handle: 1,
                next_va: 1 << 44,
                ..PhysState::default()
            })),
            hook: None,
            costs: None,
        }
    }

    /// This memory taking `costs` for its operations.
    pub(crate) fn with_costs(self, costs: DriverCosts) -> Self {
        Self {
            costs: Some(costs),
            ..self
        }
    }

    /// This memory calling `hook` with each operation as it begins, with no lock of its
    /// own held (a test may block there, or look at the caller's locks).
    #[cfg(test)]
    pub(crate) fn with_hook(self, hook: impl Fn(PhysOp) + Send + Sync + 'static) -> Self {
        Self {
            hook: Some(Hook(crate::sync::global::Arc::new(hook))),
            ..self
        }
    }

    /// Runs the hook, if there is one, for `op`; in tests, first checks that the caller
    /// holds no page heap's lock (no lock is held across a driver call).
    fn called(&self, op: PhysOp) {
        crate::device::pages::assert_unlocked(op);
        if let Some(h) = &self.hook {
            (h.0)(op);
        }
        if let Some(c) = &self.costs {
            let d = c.of(op);
            if !d.is_zero() {
                std::thread::sleep(d);
            }
        }
    }

    /// Work on `stream` uses the block at `[va, va + bytes)` (if it is on pages): checks
    /// access and that `stream` is ordered after every earlier use of its handles
    /// through other mappings (earlier blocks; uses of the same block on several
    /// streams are the cache's business), then records the use. Returns whether the
    /// block is on pages.
    pub(crate) fn use_block(&self, va: u64, bytes: usize, stream: &FakeStream) -> bool {
        self.record(va, bytes, stream, true)
    }

    /// Work on `stream` uses the live block at `[va, va + bytes)` besides its own
    /// stream's (what `record_use` declares): recorded, not checked (ordering such a use
    /// after the block's allocation is the program's business).
    pub(crate) fn use_block_elsewhere(&self, va: u64, bytes: usize, stream: &FakeStream) -> bool {
        self.record(va, bytes, stream, false)
    }

    fn record(&self, va: u64, bytes: usize, stream: &FakeStream, check: bool) -> bool {
        let mut st = lock(&self.state);
        let end = va + bytes as u64;
        let found = st.mappings_over(va, end);
        if found.is_empty() {
            return false;
        }
        let pos = stream.enqueue();
        let mut problems = Vec::new();
        let mut covered = 0usize;
        for v in found {
            let (bytes_there, found_there) = st.book_use(v, (va, end), stream, pos, check);
            covered += bytes_there;
            problems.extend(found_there);
        }
        if covered < bytes {
            problems.push(format!("block {va:#x} of {bytes} bytes only {covered} mapped"));
        }
        for p in problems {
            st.violation(p);
        }
        true
    }

    /// Whether device `peer` may access the whole of `[va, va + bytes)`.
    pub(crate) fn peer_reaches(&self, va: u64, bytes: usize, peer: usize) -> bool {
        let st = lock(&self.state);
        let end = va + bytes as u64;
        let mut covered = 0u64;
        for (&v, m) in st
            .mappings
            .range(..end)
            .rev()
            .take_while(|(&v, m)| v + m.0 as u64 > va)
        {
            if m.2 & (1 << peer) == 0 {
                return false;
            }
            covered += (v + m.0 as u64).min(end) - v.max(va);
        }
        covered == bytes as u64
    }

    /// Makes the next `n` calls of `op` fail (with a CUDA-like error that is not out of
    /// memory), changing nothing.
    #[cfg(test)]
    pub(crate) fn fail_next(&self, op: PhysOp, n: u32) {
        lock(&self.state).fail.insert(op, n);
    }

    /// The live mappings: (start, bytes), by start.
    #[cfg(test)]
    pub(crate) fn mappings(&self) -> Vec<(u64, usize)> {
        lock(&self.state)
            .mappings
            .iter()
            .map(|(&v, m)| (v, m.0))
            .collect()
    }

    /// Breaches so far.
    pub(crate) fn violations(&self) -> usize {
        lock(&self.state).violations.len()
    }

    /// (live handles, their bytes, reserved ranges, mappings).
    pub(crate) fn live(&self) -> (usize, usize, usize, usize) {
        let st = lock(&self.state);
        (
            st.handles.len(),
            st.handle_bytes,
            st.ranges.len(),
            st.mappings.len(),
        )
    }
}

impl Phys for FakePhys {
    fn granule(&self) -> usize {
        lock(&self.state).granule
    }

    fn create(&self, bytes: usize) -> Result<u64> {
        self.called(PhysOp::Create);
        let mut st = lock(&self.state);
        let g = st.granule;
        if bytes == 0 || bytes % g != 0 {
            st.violation(format!("create of {bytes} bytes"));
        }
        if st.fails(PhysOp::Create) {
            return Err(INJECTED);
        }
        if st.handle_bytes + bytes > st.limit {
            return Err(Error::OutOfMemory { requested: bytes });
        }
        let h = st.next_handle;
        st.next_handle += 1;
        st.handles.insert(h, (bytes, 0));
        st.handle_bytes += bytes;
        st.creates += 1;
        Ok(h)
    }

    unsafe fn release(&self, handle: u64) -> Result<()> {
        self.called(PhysOp::Release);
        let mut st = lock(&self.state);
        match st.handles.remove(&handle) {
            Some((bytes, maps)) => {
                st.handle_bytes -= bytes;
                st.uses.remove(&handle);
                if maps != 0 {
                    st.violation(format!("release of handle {handle} mapped {maps} times"));
                }
            }
            None => st.violation(format!("release of unknown handle {handle}")),
        }
        Ok(())
    }

    fn reserve(&self, bytes: usize) -> Result<u64> {
        self.called(PhysOp::Reserve);
        let mut st = lock(&self.state);
        if bytes == 0 || bytes % st.granule != 0 {
            st.violation(format!("reserve of {bytes} bytes"));
        }
        let va = st.next_va;
        // A gap after each range, so that a mapping past its end is caught. An address
        // space that would wrap is a reservation the driver refuses.
        st.next_va = (bytes as u64)
            .checked_add(st.granule as u64)
            .and_then(|n| va.checked_add(n))
            .ok_or(Error::OutOfMemory { requested: bytes })?;
        st.ranges.insert(va, bytes);
        Ok(va)
    }

    unsafe fn free_range(&self, va: u64, bytes: usize) -> Result<()> {
        self.called(PhysOp::FreeRange);
        let mut st = lock(&self.state);
        if st.ranges.remove(&va) != Some(bytes) {
            st.violation(format!("free of unknown range {va:#x} ({bytes} bytes)"));
        }
        if st.mappings.range(va..va + bytes as u64).next().is_some() {
            st.violation(format!("free of range {va:#x} with mappings"));
        }
        Ok(())
    }

    unsafe fn map(&self, va: u64, bytes: usize, handle: u64) -> Result<()> {
        self.called(PhysOp::Map);
        let mut st = lock(&self.state);
        if st.fails(PhysOp::Map) {
            return Err(INJECTED);
        }
        let inside = st
            .ranges
            .range(..=va)
            .next_back()
            .is_some_and(|(&r, &l)| va + bytes as u64 <= r + l as u64);
        if !inside {
            st.violation(format!("map at {va:#x} outside a reserved range"));
        }
        let overlap = st
            .mappings
            .range(..va + bytes as u64)
            .next_back()
            .is_some_and(|(&m, &(l, ..))| m + l as u64 > va);
        if overlap {
            st.violation(format!("map at {va:#x} over a mapping"));
        }
        match st.handles.get_mut(&handle) {
            Some((b, maps)) if *b == bytes => *maps += 1,
            _ => st.violation(format!("map of handle {handle} unknown or not of {bytes} bytes")),
        }
        st.next_mapping += 1;
        let id = st.next_mapping;
        st.mappings.insert(va, (bytes, handle, 0, Vec::new(), id));
        st.history
            .entry(handle)
            .or_default()
            .push(format!("map {id} at {va:#x}"));
        st.maps += 1;
        Ok(())
    }

    unsafe fn unmap(&self, va: u64, bytes: usize) -> Result<()> {
        self.called(PhysOp::Unmap);
        let mut st = lock(&self.state);
        if st.fails(PhysOp::Unmap) {
            return Err(INJECTED);
        }
        match st.mappings.remove(&va) {
            Some((l, h, _, uses, _)) if l == bytes => {
                if let Some((_, maps)) = st.handles.get_mut(&h) {
                    *maps -= 1;
                }
                for (s, p) in uses {
                    if s.completed() < p {
                        st.violation(format!(
                            "unmap of {va:#x} (handle {h}) before its use on {} at {p} completed",
                            s.id()
                        ));
                    }
                }
            }
            _ => st.violation(format!("unmap of unknown mapping {va:#x} ({bytes} bytes)")),
        }
        Ok(())
    }

    unsafe fn set_access(&self, va: u64, bytes: usize, peers: &[usize]) -> Result<()> {
        self.called(PhysOp::SetAccess);
        let mask = peers.iter().fold(1u64, |m, &p| m | 1 << p);
        let mut st = lock(&self.state);
        if st.fails(PhysOp::SetAccess) {
            return Err(INJECTED);
        }
        let mut at = va;
        let end = va + bytes as u64;
        let keys: Vec<u64> = st.mappings.range(va..end).map(|(&k, _)| k).collect();
        for k in keys {
            let m = st.mappings.get_mut(&k).expect("listed");
            if k != at {
                break;
            }
            m.2 |= mask;
            at += m.0 as u64;
        }
        if at != end {
            st.violation(format!("access to {va:#x} ({bytes} bytes) not wholly mapped"));
        }
        Ok(())
    }
}
