//! `CUDALLOC_TRACE=FILE`: a recording for the whole process, started by the first hook
//! (or the first call of the `trace` API), written to FILE at exit and at once on the
//! first out-of-memory error.
//!
//! The variable is read once, by whichever comes first; a hook reads it inside the
//! recorder's guard, so what reading it allocates is not recorded (and a `Traced` global
//! allocator does not recurse). The exit write is registered with the C library's
//! `atexit` (declared here: the crate links no `libc`), so it runs when `main` returns or
//! `std::process::exit` is called, not when the process is killed or aborts.

use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use super::{collect, Inside, TraceConfig, ENV_PENDING, STATE};
use crate::sync::global::{AtomicBool, OnceLock, Ordering};
use crate::trace::{format, Trace};

/// The file `CUDALLOC_TRACE` names, once it was read and its recording started.
static FILE: OnceLock<PathBuf> = OnceLock::new();
/// Set by the first out-of-memory error's write.
static OOM_WRITTEN: AtomicBool = AtomicBool::new(false);

/// Reads `CUDALLOC_TRACE` if nobody has, and starts its recording.
#[inline]
pub(super) fn read_once() {
    if STATE.load(Ordering::Relaxed) & ENV_PENDING != 0 {
        read();
    }
}

#[cold]
#[inline(never)]
fn read() {
    // One reader: whoever clears the bit.
    if STATE.fetch_and(!ENV_PENDING, Ordering::AcqRel) & ENV_PENDING == 0 {
        return;
    }
    // Read: the hot paths need not look for the variable any more (a recording it starts
    // raises the bit again).
    crate::observe::lower(crate::observe::TRACE, super::on);
    let _inside = Inside::enter();
    let Some(path) = std::env::var_os("CUDALLOC_TRACE").filter(|p| !p.is_empty()) else {
        return;
    };
    let path = PathBuf::from(path);
    if let Err(e) = super::start(TraceConfig::default()) {
        log::warn!("cudalloc: CUDALLOC_TRACE={}: not recording: {e}", path.display());
        return;
    }
    let _ = FILE.set(path);
    extern "C" {
        fn atexit(callback: extern "C" fn()) -> core::ffi::c_int;
    }
    // SAFETY: `atexit` takes a function of no arguments that the C library calls once at
    // exit; `write_at_exit` is one, and it unwinds nothing across the C boundary (it
    // catches panics).
    if unsafe { atexit(write_at_exit) } != 0 {
        log::warn!("cudalloc: CUDALLOC_TRACE: cannot register the write at exit");
    }
}

extern "C" fn write_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(path) = FILE.get() {
            let trace = collect(true);
            if let Err(e) = write_file(path, &trace) {
                log::error!("cudalloc: CUDALLOC_TRACE: cannot write {}: {e}", path.display());
            }
        }
    });
}

/// After an out-of-memory failure was recorded: the first one writes the trace so far
/// (the exit writes it again, whole) and logs that it did.
pub(super) fn on_out_of_memory() {
    let Some(path) = FILE.get() else {
        return;
    };
    if OOM_WRITTEN.swap(true, Ordering::Relaxed) {
        return;
    }
    let _inside = Inside::enter();
    let trace = collect(false);
    match write_file(path, &trace) {
        Ok(()) => log::error!(
            "cudalloc: out of memory; the allocation trace so far is in {} (CUDALLOC_TRACE)",
            path.display()
        ),
        Err(e) => log::error!(
            "cudalloc: out of memory; cannot write the trace to {}: {e}",
            path.display()
        ),
    }
}

/// Writes `trace` to `path` in the format its extension names: `.pickle` / `.pkl`
/// PyTorch's memory snapshot, `.svg` the timeline, anything else RMM's CSV log.
fn write_file(path: &Path, trace: &Trace) -> io::Result<()> {
    let mut out = io::BufWriter::new(std::fs::File::create(path)?);
    write_as(path, trace, &mut out)?;
    out.flush()
}

/// Writes `trace` to `out` in the format `path`'s extension names.
fn write_as(path: &Path, trace: &Trace, out: &mut impl io::Write) -> io::Result<()> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("pickle" | "pkl") => format::torch::write(trace, out),
        Some("svg") => out.write_all(format::svg::timeline(trace).as_bytes()),
        _ => format::rmm::write(trace, out).map(|_| ()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Action, Event};
    use std::borrow::Cow;

    #[test]
    fn rmm_rows_have_rmms_shape() {
        let mut t = Trace::default();
        let mut a = Event::new(Action::Alloc, 0x7f00_1000, 256);
        a.time_ns = 3_723_000_004_000; // 1 h 2 min 3 s 4 us
        a.thread = 2;
        let f = Event::new(Action::FreeRequested, 0x7f00_1000, 256);
        let done = Event::new(Action::FreeCompleted, 0x7f00_1000, 256);
        let mut fail = Event::new(Action::Failure(Cow::Borrowed("out of memory")), 0, 1 << 40);
        fail.stream = 0x10;
        t.events = vec![a, f, done, fail];
        let mut out = Vec::new();
        write_as(Path::new("trace.csv"), &t, &mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "Thread,Time,Action,Pointer,Size,Stream\n\
             2,01:02:03.000004,allocate,0x7f001000,256,0x0\n\
             0,00:00:00.000000,free,0x7f001000,256,0x0\n\
             0,00:00:00.000000,allocate failure,(nil),1099511627776,0x10\n"
        );
    }

    #[test]
    fn the_extension_chooses_the_format() {
        let mut t = Trace::default();
        t.events.push(Event::new(Action::Alloc, 0x7f00_1000, 256));
        let written = |name: &str| {
            let mut out = Vec::new();
            write_as(Path::new(name), &t, &mut out).unwrap();
            out
        };
        let pickle = written("dump.pickle");
        assert_eq!(&pickle[..2], b"\x80\x03");
        assert_eq!(format::torch::read(&pickle).unwrap().events.len(), 1);
        assert_eq!(written("dump.PKL"), pickle);
        assert!(written("dump.svg").starts_with(b"<svg"));
        assert!(written("dump").starts_with(b"Thread,Time,Action"));
        assert!(written("dump.log").starts_with(b"Thread,Time,Action"));
    }
}
