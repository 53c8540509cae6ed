//! Allocation sites of a trace (feature `backtrace`): return addresses captured in the
//! hook with the `backtrace` crate's unsynchronized walker (no lock of std's, no
//! allocation: see `count::sites`, which captures the same way), resolved to names by
//! `stop`, outside every hook.

use core::ffi::c_void;

use crate::trace::Frame;

/// Fills `ips` with the return addresses of the calling stack, innermost first; returns
/// how many it wrote (the crate's one stack walker, shared with `count::sites`).
pub(super) fn capture(ips: &mut [usize]) -> usize {
    crate::util::capture_stack(ips)
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
        || crate::util::is_walker_or_shim_frame(name)
        || name.starts_with("alloc::alloc::")
        || name.starts_with("<allocator_api2::")
        || name.starts_with("allocator_api2::")
}
