//! Runs N hit pairs of one hot path, for counting their instructions with callgrind,
//! which counts the same for the same binary and input however busy the machine is (a
//! VM's timings move by more than the nanosecond these questions are about).
//! `tools/hit-instructions.sh` runs it under callgrind at N and 2N pairs and prints
//! the difference per pair, for every path and, with `--cfg cudalloc_no_nvtx`, with
//! the NVTX annotations compiled out.
//!
//! ```text
//! cargo run --release --example hit_instructions -- PATH N [BYTES]
//! ```
//!
//! PATH: `host_pool` (`Pool<HostSource>`, 256 B), `device_sim` (`SimPool::annotated`,
//! `DevicePool`'s hot path on the simulated GPU, 256 B), `device_sim_bare` (the same with
//! the NVTX branch compiled out; BYTES sets their request, 256 by default, e.g. 16 MiB for
//! a large block's path), `system` (`System`, 256 B), `counting`
//! (`Counting<System>`, 256 B). The host paths' pairs write the block's first byte; the
//! `device_sim` paths allocate and free only.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::process::ExitCode;

use allocator_api2::alloc::Allocator;
use cudalloc::count::Counting;
use cudalloc::device::sim::{SimPool, SimStream};
use cudalloc::pool::Pool;
use cudalloc::source::HostSource;

/// Warm-up pairs before the counted ones (thread caches made, first blocks taken).
const WARM: u64 = 1000;

static COUNTING: Counting<System> = Counting::new(System);

/// Runs `pair` `WARM + n` times.
fn run(n: u64, mut pair: impl FnMut()) {
    for _ in 0..WARM + n {
        pair();
    }
}

/// One `GlobalAlloc` pair of 256 B on `a`, writing the block's first byte.
fn global_pair(a: &impl GlobalAlloc) {
    let l = black_box(Layout::from_size_align(256, 8).expect("layout"));
    // SAFETY: a nonzero layout; the block is written within its size and freed once with
    // the layout it was allocated with.
    unsafe {
        let p = a.alloc(l);
        if p.is_null() {
            return;
        }
        p.write_volatile(1);
        a.dealloc(p, l);
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(path), Some(Ok(n))) = (args.first(), args.get(1).map(|n| n.parse::<u64>())) else {
        eprintln!("usage: hit_instructions PATH N [BYTES] (see the comment at the top of the file)");
        return ExitCode::from(2);
    };
    let Ok(bytes) = args.get(2).map_or(Ok(256), |b| b.parse::<usize>()) else {
        eprintln!("hit_instructions: BYTES must be a number");
        return ExitCode::from(2);
    };
    match path.as_str() {
        "host_pool" => {
            let pool = Pool::new(HostSource);
            let l = Layout::from_size_align(256, 8).expect("layout");
            run(n, || {
                let b = pool.allocate(black_box(l)).expect("host pool");
                // SAFETY: the block holds at least 256 bytes and is freed once with its
                // layout.
                unsafe {
                    b.cast::<u8>().as_ptr().write_volatile(1);
                    pool.deallocate(b.cast(), l);
                }
            });
        }
        "device_sim" | "device_sim_bare" => {
            let s = SimStream::new();
            if path == "device_sim" {
                let pool = SimPool::annotated(256 << 20);
                run(n, || {
                    drop(black_box(pool.alloc(black_box(bytes), &s).expect("sim")))
                });
            } else {
                let pool = SimPool::bare(256 << 20);
                run(n, || {
                    drop(black_box(pool.alloc(black_box(bytes), &s).expect("sim")))
                });
            }
        }
        "system" => run(n, || global_pair(&System)),
        "counting" => run(n, || global_pair(&COUNTING)),
        other => {
            eprintln!("hit_instructions: unknown path {other}");
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}
