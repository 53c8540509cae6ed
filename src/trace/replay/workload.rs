//! RMM's random workload as a trace, so it replays (and is written, read and compared)
//! like a recorded one.

use crate::trace::{Action, Event, Trace, TraceMemory, TracedAllocator};

/// The parameters of RMM's `random_allocations` benchmark.
/// Build one with struct update syntax: `RandomWorkload { allocations: 500, ..RandomWorkload::small() }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RandomWorkload {
    /// Allocations (the trace has at most twice as many steps, then frees what is live).
    pub allocations: usize,
    /// Sizes are uniform in `1..=max_size`.
    pub max_size: u64,
    /// Bytes live at most.
    pub max_usage: u64,
    /// Streams, chosen at random per allocation (a block is freed on its stream).
    pub streams: u32,
    /// Recording threads, chosen at random per event.
    pub threads: u32,
    /// The generator's seed (xorshift64; not 0).
    pub seed: u64,
}

impl RandomWorkload {
    /// RMM's parameters: 10^5 allocations up to 64 MiB, at most 16000 MiB live, 4
    /// streams, one thread.
    pub const fn rmm() -> Self {
        Self {
            allocations: 100_000,
            max_size: 64 << 20,
            max_usage: 16_000 << 20,
            streams: 4,
            threads: 1,
            seed: 0x2545_F491_4F6C_DD1D,
        }
    }

    /// RMM's shape scaled down for tests: 1000 allocations up to 1 MiB, at most 64 MiB
    /// live, 4 streams, one thread.
    pub const fn small() -> Self {
        Self {
            allocations: 1000,
            max_size: 1 << 20,
            max_usage: 64 << 20,
            ..Self::rmm()
        }
    }
}

/// RMM's `random_allocations` as a trace: `2 * allocations` steps; while under
/// `max_usage`, 73% of them allocate (a uniform size, a random stream), the rest free a
/// random live block on its stream; then the live blocks are freed. Addresses are
/// distinct (a bump of 256-byte-aligned blocks), times 1 us apart. The same parameters
/// give the same trace.
///
/// ```
/// use cudalloc::trace::replay::{random_workload, RandomWorkload};
/// let w = RandomWorkload { allocations: 500, ..RandomWorkload::small() };
/// let t = random_workload(&w);
/// assert_eq!(t, random_workload(&w));
/// let allocs = t.events.iter().filter(|e| e.action == cudalloc::trace::Action::Alloc).count();
/// assert!(allocs <= 500);
/// assert_eq!(t.events.len(), 2 * allocs);
/// ```
pub fn random_workload(w: &RandomWorkload) -> Trace {
    let mut x = w.seed.max(1);
    let mut below = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n.max(1)
    };
    let mut t = Trace::default();
    t.allocators.push(TracedAllocator::new(
        "RMM random workload",
        TraceMemory::Device,
        0,
    ));
    let mut live: Vec<(u64, u64, u64)> = Vec::new(); // (addr, size, stream)
    let (mut requested, mut count, mut next_addr) = (0u64, 0usize, 1u64 << 40);
    let push = |t: &mut Trace, action: Action, addr: u64, size: u64, stream: u64, thread: u32| {
        let mut e = Event::new(action, addr, size);
        e.seq = t.events.len() as u64;
        e.time_ns = e.seq * 1000;
        e.stream = stream;
        e.thread = thread;
        e.align = 256;
        t.events.push(e);
    };
    for _ in 0..w.allocations * 2 {
        let size = 1 + below(w.max_size);
        let do_alloc =
            live.is_empty() || (below(100) < 73 && count < w.allocations && requested + size <= w.max_usage);
        let thread = below(u64::from(w.threads)) as u32;
        if do_alloc {
            if requested + size > w.max_usage {
                continue;
            }
            let stream = below(u64::from(w.streams));
            push(&mut t, Action::Alloc, next_addr, size, stream, thread);
            live.push((next_addr, size, stream));
            next_addr += size.div_ceil(256) * 256;
            requested += size;
            count += 1;
        } else {
            let i = below(live.len() as u64) as usize;
            let (addr, size, stream) = live.swap_remove(i);
            push(&mut t, Action::FreeRequested, addr, size, stream, thread);
            requested -= size;
        }
    }
    for (addr, size, stream) in live {
        push(&mut t, Action::FreeRequested, addr, size, stream, 0);
    }
    t
}
