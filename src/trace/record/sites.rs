//! Allocation sites of a trace (feature `backtrace`): return addresses captured in the
//! hook with the `backtrace` crate's unsynchronized walker (no lock of std's, no
//! allocation: see `count::sites`, which captures the same way), resolved to names by
//! `stop`, outside every hook.

use core::ffi::c_void;

use crate::trace::Frame;

/// Fills `ips` with the return addresses of the calling stack, innermost first; returns
/// how many it wrote.
pub(super) fn capture(ips: &mut [usize]) -> usize {
    let mut depth = 0;
    let mut push = |frame: &backtrace::Frame| {
        if let Some(slot) = ips.get_mut(depth) {
            *slot = frame.ip() as usize;
            depth += 1;
        }
        depth < ips.len()
    };
    // 32-bit Windows walks the stack with dbghelp, which is not thread-safe.
    #[cfg(all(windows, target_arch = "x86"))]
    backtrace::trace(&mut push);
    #[cfg(not(all(windows, target_arch = "x86")))]
    // SAFETY: `trace_unsynchronized` is unsafe only because some stack walkers are not
    // thread-safe (dbghelp's, used on 32-bit Windows, which takes the synchronized path
    // above); elsewhere it calls the platform unwinder, which is. The callback neither
    // panics nor allocates.
    unsafe {
        backtrace::trace_unsynchronized(&mut push)
    };
    depth
}

/// The frames at `ips` (inlined functions included), the recorder's and the
/// allocators' own frames left out: those up to the last frame of the allocating
/// machinery.
pub(super) fn resolve(ips: &[usize]) -> Vec<Frame> {
    let mut frames = Vec::new();
    for &ip in ips {
        let mut named = false;
        backtrace::resolve(ip as *mut c_void, |symbol| {
            named = true;
            let name = symbol
                .name()
                .map_or_else(|| "??".to_owned(), |n| format!("{n:#}"));
            let file = symbol
                .filename()
                .map_or_else(String::new, |f| f.display().to_string());
            frames.push(Frame::new(name, file, symbol.lineno().unwrap_or(0)));
        });
        if !named {
            frames.push(Frame::new("??", "", 0));
        }
    }
    let cut = frames
        .iter()
        .rposition(|f| is_allocator_frame(&f.name))
        .map_or(0, |i| i + 1);
    frames.drain(..cut);
    frames
}

/// Whether a function belongs to the allocating side of a captured stack.
fn is_allocator_frame(name: &str) -> bool {
    const OURS: [&str; 6] = [
        "cudalloc::trace::",
        "cudalloc::pool::",
        "cudalloc::arena::",
        "cudalloc::direct::",
        "cudalloc::handle::",
        "cudalloc::count::",
    ];
    (OURS.iter().any(|m| name.contains(m)) && !name.contains("::tests::"))
        || name.starts_with("backtrace::")
        || name.starts_with("<backtrace::")
        || name.starts_with("_Unwind_")
        || name.contains("__rust_alloc")
        || name.contains("__rust_realloc")
        || name.contains("__rg_alloc")
        || name.contains("__rg_realloc")
        || name.starts_with("alloc::alloc::")
        || name.starts_with("<allocator_api2::")
        || name.starts_with("allocator_api2::")
}
