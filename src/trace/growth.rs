//! A driver pool's growth and shrinking as segment events. The driver grows a `cuMemPool`
//! by chunks of its choosing and says only how much it reserves
//! (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`): while a recording runs, a device pool reads
//! that figure after each allocation that reached its driver pool and after each trim,
//! and [`PoolReservation`] records the change, a growth as `SegmentAlloc`, a decrease as
//! `SegmentFree`. Off, each hook is the recorder's one load and branch.

use super::record::{on, session, Code, Note, Tag};
use crate::sync::global::{lock, AtomicU64, Mutex, Ordering};

/// What a driver pool reserves, as the trace has told it (see the module docs).
///
/// The addresses: the driver does not say where a chunk starts, so a growth is recorded
/// at the address of the allocation after which it was seen (an address inside the pool,
/// distinct from every other live growth's: each is a live block's), with that
/// allocation's stream. The driver does not say either which chunks a trim gave back:
/// the newest recorded growths go first, each `SegmentFree` with its growth's address,
/// size and stream (so formats that pair segments by address pair them); a decrease that
/// ends inside a growth frees it whole and records its remainder again at its address;
/// a decrease past every recorded growth gives back memory the pool reserved before the
/// recording started, recorded as a `SegmentFree` at address 0.
#[derive(Debug, Default)]
pub(crate) struct PoolReservation {
    /// `watched.session`, readable without the lock (0: no recording seen yet).
    session: AtomicU64,
    watched: Mutex<Watched>,
}

#[derive(Debug, Default)]
struct Watched {
    /// The recording whose figures these are.
    session: u64,
    /// `before_recording + Σ growths.bytes == reserved`, the pool's reservation at its
    /// last reading.
    reserved: u64,
    /// Bytes reserved when the recording first read the pool and not given back since.
    before_recording: u64,
    /// The recorded growths still reserved, oldest first.
    growths: Vec<Growth>,
}

#[derive(Clone, Copy, Debug)]
struct Growth {
    addr: u64,
    bytes: u64,
    stream: u64,
}

impl PoolReservation {
    /// A pool no recording has read yet.
    pub(crate) const fn new() -> Self {
        Self {
            session: AtomicU64::new(0),
            watched: Mutex::new(Watched {
                session: 0,
                reserved: 0,
                before_recording: 0,
                growths: Vec::new(),
            }),
        }
    }

    /// Before an allocation that may reach the driver pool: on a recording's first, reads
    /// what the pool reserves from before it (`reserved`: the driver's figure, `None`
    /// when it cannot say), so that the allocation's growth is told from it.
    #[inline(always)]
    pub(crate) fn before(&self, reserved: impl FnOnce() -> Option<u64>) {
        if on() {
            self.before_cold(&mut Some(reserved));
        }
    }

    #[cold]
    #[inline(never)]
    fn before_cold(&self, reserved: &mut Option<impl FnOnce() -> Option<u64>>) {
        let Some(now) = session() else { return };
        if self.session.load(Ordering::Relaxed) == now {
            return;
        }
        let mut w = lock(&self.watched);
        if w.session != now {
            if let Some(r) = reserved.take().and_then(|f| f()) {
                w.begin(now, r);
                self.session.store(now, Ordering::Relaxed);
            }
        }
    }

    /// After an allocation of the block at `addr` on `stream` reached the driver pool,
    /// or after a trim (`addr` 0, `stream` 0): the change since the last reading,
    /// recorded on `tag`.
    #[inline(always)]
    pub(crate) fn after(&self, tag: &Tag, addr: u64, stream: u64, reserved: impl FnOnce() -> Option<u64>) {
        if on() {
            self.after_cold(tag, addr, stream, &mut Some(reserved));
        }
    }

    #[cold]
    #[inline(never)]
    fn after_cold(
        &self,
        tag: &Tag,
        addr: u64,
        stream: u64,
        reserved: &mut Option<impl FnOnce() -> Option<u64>>,
    ) {
        let Some(now) = session() else { return };
        // Read and recorded under the lock: the trace's order of a pool's segment events
        // is the order of its readings, so that its growths and decreases add up.
        let mut w = lock(&self.watched);
        let Some(r) = reserved.take().and_then(|f| f()) else {
            return;
        };
        if w.session != now {
            // The recording started between the allocation and this reading: what the
            // pool reserves now counts as from before it.
            w.begin(now, r);
            self.session.store(now, Ordering::Relaxed);
            return;
        }
        w.change(
            tag,
            r,
            Growth {
                addr,
                bytes: 0,
                stream,
            },
        );
    }

    /// The driver pool is destroyed (with its backend): every recorded growth is given
    /// back.
    pub(crate) fn destroyed(&self, tag: &Tag) {
        if on() {
            let Some(now) = session() else { return };
            let mut w = lock(&self.watched);
            if w.session == now {
                w.change(
                    tag,
                    0,
                    Growth {
                        addr: 0,
                        bytes: 0,
                        stream: 0,
                    },
                );
            }
        }
    }
}

impl Watched {
    fn begin(&mut self, session: u64, reserved: u64) {
        self.session = session;
        self.reserved = reserved;
        self.before_recording = reserved;
        self.growths.clear();
    }

    /// The pool reserves `reserved` bytes now: a growth at `at`'s address and stream, or
    /// the newest growths given back.
    fn change(&mut self, tag: &Tag, reserved: u64, at: Growth) {
        let segment = |action, g: Growth| {
            tag.event(|| Note {
                stream: g.stream,
                ..Note::new(action, g.addr as usize, g.bytes as usize)
            })
        };
        if reserved > self.reserved {
            let g = Growth {
                bytes: reserved - self.reserved,
                ..at
            };
            if self.growths.try_reserve(1).is_ok() {
                self.growths.push(g);
            } else {
                // No room to remember it: it counts as from before the recording (its
                // release is then recorded at address 0).
                self.before_recording += g.bytes;
            }
            segment(Code::SegmentAlloc, g);
        }
        let mut gone = self.reserved.saturating_sub(reserved);
        while gone > 0 {
            let Some(g) = self.growths.pop() else {
                let bytes = gone.min(self.before_recording);
                self.before_recording -= bytes;
                if bytes > 0 {
                    segment(
                        Code::SegmentFree,
                        Growth {
                            addr: 0,
                            bytes,
                            stream: 0,
                        },
                    );
                }
                break;
            };
            segment(Code::SegmentFree, g);
            if g.bytes > gone {
                let rest = Growth {
                    bytes: g.bytes - gone,
                    ..g
                };
                self.growths.push(rest);
                segment(Code::SegmentAlloc, rest);
                gone = 0;
            } else {
                gone -= g.bytes;
            }
        }
        self.reserved = reserved;
        debug_assert_eq!(
            self.before_recording + self.growths.iter().map(|g| g.bytes).sum::<u64>(),
            self.reserved,
            "the recorded growths and what was reserved before add up to the reservation"
        );
    }
}
