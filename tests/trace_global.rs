//! `Traced<System>` installed as the global allocator, and `CUDALLOC_TRACE`. Its own
//! binary (harness = false): a test binary has one global allocator, and the
//! environment variable is read once per process (the test runs a copy of itself with
//! it set).
//!
//! - the recorder records every heap allocation of the program (std's `Vec`, `String`,
//!   threads) through the global allocator without recursing or deadlocking, though
//!   it allocates itself (its buffers, the trace `stop` builds);
//! - `CUDALLOC_TRACE=FILE` records from the first allocation (read inside the global
//!   allocator, before `main`), writes RMM's CSV at the first out-of-memory error, and
//!   again, whole, at exit.

use std::alloc::{Layout, System};

use allocator_api2::alloc::Allocator;
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::HostSource;
use cudalloc::trace::{self, Action, TraceConfig, Traced};

#[global_allocator]
static GLOBAL: Traced<System> = Traced::new(System);

const CHILD: &str = "TRACE_GLOBAL_CHILD";

fn the_global_allocator_is_recorded() {
    trace::start(TraceConfig::default()).unwrap();
    let v: Vec<u64> = Vec::with_capacity(1234);
    let s = format!("{}", v.capacity());
    std::thread::spawn(|| drop(std::hint::black_box(vec![0u8; 4321])))
        .join()
        .unwrap();
    drop((v, s));
    let t = trace::stop();
    let global = t
        .allocators
        .iter()
        .position(|a| a.name == "Traced<System>")
        .expect("the global allocator recorded") as u32;
    let mine: Vec<_> = t.events.iter().filter(|e| e.allocator == global).collect();
    let alloc = mine
        .iter()
        .find(|e| e.action == Action::Alloc && e.size == 1234 * 8)
        .expect("the Vec's allocation");
    assert_eq!(alloc.align, 8);
    assert!(
        mine.iter()
            .any(|e| e.action == Action::FreeRequested && e.addr == alloc.addr && e.seq > alloc.seq),
        "its free"
    );
    let other = mine
        .iter()
        .find(|e| e.action == Action::Alloc && e.size == 4321)
        .expect("the thread's allocation");
    assert_ne!(other.thread, alloc.thread, "another thread");
    assert_eq!(t.dropped, 0);
}

/// The copy of this program that runs with `CUDALLOC_TRACE` set.
fn child(file: &str) {
    assert!(trace::is_recording(), "CUDALLOC_TRACE started a recording");
    let v: Vec<u8> = Vec::with_capacity(12345);
    drop(v);
    let pool = Pool::with_config(
        HostSource,
        PoolConfig::default().with_limit(4 << 20).with_pending_wait(None),
    );
    assert!(pool
        .allocate(Layout::from_size_align(8 << 20, 8).unwrap())
        .is_err());
    // Written at once, before exit.
    let text = std::fs::read_to_string(file).expect("written at the out-of-memory error");
    assert!(text.contains(",allocate failure,(nil),8388608,"), "{text}");
    assert!(!text.contains(",99999,"), "the allocation below is not in it yet");
    drop(std::hint::black_box(Vec::<u8>::with_capacity(99999)));
}

fn cudalloc_trace_writes_the_file_at_out_of_memory_and_at_exit() {
    let dir = std::env::temp_dir().join(format!("cudalloc-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("trace.csv");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env("CUDALLOC_TRACE", &file)
        .env(CHILD, &file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&file).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("Thread,Time,Action,Pointer,Size,Stream"));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert!(rows.iter().all(|r| r.len() == 6), "six fields a row");
    let alloc = rows
        .iter()
        .find(|r| r[2] == "allocate" && r[4] == "12345")
        .expect("the child's Vec");
    assert!(alloc[3].starts_with("0x"), "{alloc:?}");
    assert_eq!(alloc[1].len(), "00:00:00.000000".len(), "{alloc:?}");
    assert!(
        rows.iter().any(|r| r[2] == "free" && r[3] == alloc[3]),
        "its free"
    );
    assert!(rows.iter().any(|r| r[2] == "allocate failure" && r[3] == "(nil)"));
    assert!(
        rows.iter().any(|r| r[2] == "allocate" && r[4] == "99999"),
        "the exit write is whole"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn main() {
    if let Some(file) = std::env::var_os(CHILD) {
        child(file.to_str().unwrap());
        return;
    }
    if trace::is_recording() {
        println!("skipped: CUDALLOC_TRACE records this process");
        return;
    }
    the_global_allocator_is_recorded();
    println!("test the_global_allocator_is_recorded ... ok");
    cudalloc_trace_writes_the_file_at_out_of_memory_and_at_exit();
    println!("test cudalloc_trace_writes_the_file_at_out_of_memory_and_at_exit ... ok");
}
