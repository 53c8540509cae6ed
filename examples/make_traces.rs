//! Writes the sample traces of `traces/`: RMM's random workload (RMM's CSV log) and a
//! recording of a program that grows `Vec`s on three threads (PyTorch's snapshot format,
//! host memory).
//!
//!     cargo run --release --example make_traces [-- DIR]
//!     cargo run --release --example make_traces -- DIR N   # only DIR/rmm_random_N.csv
//!
//! With N, only RMM's random workload of N allocations (sizes up to 64 MiB, at most
//! 2000 MiB live, 4 streams: RMM's shape with an eighth of its cap), for measuring
//! replay speed; the file is not a sample (it exceeds 1 MB from about 10^4 allocations).
//!
//! The recording here goes through a small wrapper around `Global` private to this
//! example (every allocate, grow and free noted under one lock): enough to make a
//! sample; programs record through the crate's `trace` module.

use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Mutex;
use std::time::Instant;

use allocator_api2::alloc::{AllocError, Allocator, Global, Layout};
use allocator_api2::vec::Vec as AVec;
use cudalloc::trace::format::{rmm, torch};
use cudalloc::trace::replay::{random_workload, RandomWorkload};
use cudalloc::trace::{Action, Event, Trace, TraceMemory, TracedAllocator};

/// The recording: events in the order the lock saw them.
struct Recorder {
    start: Instant,
    events: Mutex<Vec<Event>>,
}

/// `Global`, noting each allocation and free with the recording thread's number.
#[derive(Clone, Copy)]
struct Rec<'a> {
    recorder: &'a Recorder,
    thread: u32,
}

impl Rec<'_> {
    fn note(&self, action: Action, ptr: NonNull<u8>, size: usize, given: usize, align: usize) {
        let mut events = self.recorder.events.lock().unwrap();
        let mut e = Event::new(action, ptr.as_ptr() as u64, size as u64);
        e.seq = events.len() as u64;
        e.time_ns = self.recorder.start.elapsed().as_nanos() as u64;
        e.thread = self.thread;
        e.given = given as u64;
        e.align = align as u64;
        events.push(e);
    }
}

// SAFETY: every block comes from `Global` and goes back to it with its layout; the
// wrapper only notes the calls (grow and shrink take the trait's default paths, an
// allocation, a copy and a free, which are noted as such).
unsafe impl Allocator for Rec<'_> {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let p = Global.allocate(layout)?;
        if layout.size() > 0 {
            self.note(Action::Alloc, p.cast(), layout.size(), p.len(), layout.align());
        }
        Ok(p)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() > 0 {
            // Noted before the memory can be handed out again.
            self.note(
                Action::FreeRequested,
                ptr,
                layout.size(),
                layout.size(),
                layout.align(),
            );
        }
        // SAFETY: `ptr` was allocated by `Global` (through `allocate`) with `layout`.
        unsafe { Global.deallocate(ptr, layout) }
    }
}

/// Each thread: a `Vec<u64>` pushed to 100 000 elements (doubling), and 300 byte
/// buffers of pseudo-random sizes, the last 16 of them kept alive.
fn vec_growth() -> Trace {
    let recorder = Recorder {
        start: Instant::now(),
        events: Mutex::new(Vec::new()),
    };
    std::thread::scope(|s| {
        for thread in 0..3u32 {
            let a = Rec {
                recorder: &recorder,
                thread,
            };
            s.spawn(move || {
                let mut v: AVec<u64, Rec<'_>> = AVec::new_in(a);
                let mut window: std::collections::VecDeque<AVec<u8, Rec<'_>>> = Default::default();
                let mut x = 0x9E37_79B9u32 ^ thread;
                for i in 0..100_000u64 {
                    v.push(i);
                    if i % 333 == 0 {
                        x ^= x << 13;
                        x ^= x >> 17;
                        x ^= x << 5;
                        let mut b = AVec::with_capacity_in(16 + (x as usize % 8000), a);
                        b.push(thread as u8);
                        window.push_back(b);
                        if window.len() > 16 {
                            window.pop_front();
                        }
                    }
                }
                std::hint::black_box(v.iter().sum::<u64>());
            });
        }
    });
    let mut t = Trace::default();
    t.allocators.push(TracedAllocator::new(
        "Global (Vec growth, 3 threads)",
        TraceMemory::Host,
        0,
    ));
    t.events = recorder.events.into_inner().unwrap();
    t
}

fn save(path: &Path, write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    write(&mut f)?;
    let len = std::fs::metadata(path)?.len();
    println!("{}: {} KiB", path.display(), len / 1024);
    Ok(())
}

fn main() -> std::io::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "traces".into()));
    std::fs::create_dir_all(&dir)?;
    if let Some(n) = std::env::args().nth(2) {
        let n: usize = n
            .parse()
            .map_err(|_| std::io::Error::other(format!("N: `{n}` is not a number")))?;
        let w = random_workload(&RandomWorkload {
            allocations: n,
            max_usage: 2000 << 20,
            ..RandomWorkload::rmm()
        });
        return save(&dir.join(format!("rmm_random_{n}.csv")), |f| {
            rmm::write(&w, f).map(drop)
        });
    }
    // RMM's shape (uniform sizes, 73% allocations while under the cap, 4 streams) scaled
    // to stay under 1 MB of CSV and to replay on a CI machine's host memory: 7000
    // allocations up to 16 MiB, at most 512 MiB live.
    let rmm_random = random_workload(&RandomWorkload {
        allocations: 7000,
        max_size: 16 << 20,
        max_usage: 512 << 20,
        ..RandomWorkload::rmm()
    });
    save(&dir.join("rmm_random.csv"), |f| {
        rmm::write(&rmm_random, f).map(drop)
    })?;
    let growth = vec_growth();
    save(&dir.join("vec_growth.pickle"), |f| torch::write(&growth, f))?;
    Ok(())
}
