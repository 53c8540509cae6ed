//! Small helpers every layer uses, kept in one leaf module: alignment arithmetic, dangling
//! pointers for zero-size blocks, the page size, the machine's physical memory, and the
//! parsing of the crate's environment variables.

use core::ptr::NonNull;

use allocator_api2::alloc::Layout;

/// The host's page size (4 KiB on the platforms CUDA supports); pinned and registered
/// memory is handled in whole pages.
pub const PAGE_SIZE: usize = 4096;

/// Rounds `n` up to a multiple of `align` (a power of two); `None` on overflow.
#[inline]
pub(crate) const fn align_up(n: usize, align: usize) -> Option<usize> {
    match n.checked_add(align - 1) {
        Some(v) => Some(v & !(align - 1)),
        None => None,
    }
}

/// A well-aligned dangling pointer for a zero-size block; never dereferenced or freed.
#[inline]
pub(crate) fn dangling(align: usize) -> NonNull<u8> {
    let p = core::ptr::without_provenance_mut::<u8>(align);
    // SAFETY: an alignment is never zero, so `p` is non-null.
    unsafe { NonNull::new_unchecked(p) }
}

/// A zero-length block for `layout`, at a dangling, aligned address.
#[inline]
pub(crate) fn dangling_block(layout: Layout) -> NonNull<[u8]> {
    NonNull::slice_from_raw_parts(dangling(layout.align()), 0)
}

/// Physical memory of this machine in bytes, read once from `/proc/meminfo` (`None` where
/// it cannot be read). Sources refuse requests above it: with unlimited overcommit the
/// system would hand out address space that faults later.
pub(crate) fn physical_memory() -> Option<usize> {
    use crate::sync::global::OnceLock;
    static MEM: OnceLock<Option<usize>> = OnceLock::new();
    *MEM.get_or_init(|| {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    })
}

/// Refuses a request for more than this machine's physical memory (`Error::TooLarge`);
/// where that is unknown, accepts it.
pub(crate) fn check_physical_memory(bytes: usize) -> crate::error::Result<()> {
    match physical_memory() {
        Some(phys) if bytes > phys => Err(crate::error::Error::TooLarge {
            requested: bytes,
            limit: phys,
        }),
        _ => Ok(()),
    }
}

/// Parses a byte count: digits, then optionally spaces and a unit `K`, `M`, `G` or `T`
/// (powers of 1024) written alone or followed by `B` or `iB` (any case): `1048576`, `8G`,
/// `512MiB`, `4 KB`. Anything else (`8bbbb`, `1.5G`, `-1`) is `None`, as is an overflow.
pub(crate) fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if digits == 0 {
        return None;
    }
    let n: usize = s[..digits].parse().ok()?;
    let unit = s[digits..].trim_start().to_ascii_uppercase();
    let shift = match unit.as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return None,
    };
    n.checked_mul(1usize << shift)
}

/// Parses a boolean switch: `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off`, empty
/// (any case, surrounding spaces ignored). Anything else is `None`.
pub(crate) fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" | "" => Some(false),
        _ => None,
    }
}

/// Reads environment variable `name` and parses it with `parse`. Unset: `None`, silently.
/// Set but not valid UTF-8, or refused by `parse`: `None`, with one warning in the log that
/// names the variable, the value and `expected`, so a typo is never read silently wrong.
pub(crate) fn env_var<T>(name: &str, expected: &str, parse: impl FnOnce(&str) -> Option<T>) -> Option<T> {
    let raw = std::env::var_os(name)?;
    let parsed = raw.to_str().and_then(parse);
    if parsed.is_none() {
        log::warn!("cudalloc: ignoring {name}={raw:?}: expected {expected}");
    }
    parsed
}

/// Fills `ips` with the return addresses of the calling stack, innermost first; returns
/// how many it wrote. Takes no lock of std's and allocates nothing, so the counting
/// allocator and the trace recorder call it inside an allocation (feature `backtrace`).
#[cfg(feature = "backtrace")]
pub(crate) fn capture_stack(ips: &mut [usize]) -> usize {
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
    // above); elsewhere it calls the platform unwinder (`_Unwind_Backtrace`, or
    // `RtlVirtualUnwind` on 64-bit Windows), which is. The callback neither panics nor
    // allocates.
    unsafe {
        backtrace::trace_unsynchronized(&mut push)
    };
    depth
}

/// Whether a resolved frame's function belongs to the machinery below every allocation
/// site: the stack walker, the unwinder and the allocation shims (`__rust_alloc` and
/// kin). Shared by the counting allocator's leak reports and the trace recorder's sites,
/// which each add their own modules to it.
#[cfg_attr(loom, allow(dead_code))]
pub(crate) fn is_walker_or_shim_frame(name: &str) -> bool {
    name.starts_with("backtrace::")
        || name.starts_with("<backtrace::")
        || name.starts_with("_Unwind_")
        || name.contains("__rust_alloc")
        || name.contains("__rust_realloc")
        || name.contains("__rg_alloc")
        || name.contains("__rg_realloc")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse_with_units_and_nothing_else() {
        assert_eq!(parse_bytes("1048576"), Some(1 << 20));
        assert_eq!(parse_bytes("8G"), Some(8 << 30));
        assert_eq!(parse_bytes("8g"), Some(8 << 30));
        assert_eq!(parse_bytes("512MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("512 mib"), Some(512 << 20));
        assert_eq!(parse_bytes("4 KB"), Some(4096));
        assert_eq!(parse_bytes("4096B"), Some(4096));
        assert_eq!(parse_bytes(" 2M "), Some(2 << 20));
        for bad in [
            "lots",
            "3X",
            "8bbbb",
            "8BB",
            "8iB",
            "1.5G",
            "-1",
            "",
            "G",
            "99999999999T",
            "8 G B",
        ] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn switches_parse_as_documented() {
        for on in ["1", "true", "TRUE", "yes", "on", " On "] {
            assert_eq!(parse_bool(on), Some(true), "{on:?}");
        }
        for off in ["0", "false", "no", "off", "", "  "] {
            assert_eq!(parse_bool(off), Some(false), "{off:?}");
        }
        for bad in ["2", "y", "enable", "truthy"] {
            assert_eq!(parse_bool(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn align_up_rounds_and_detects_overflow() {
        assert_eq!(align_up(0, 4096), Some(0));
        assert_eq!(align_up(1, 4096), Some(4096));
        assert_eq!(align_up(4096, 4096), Some(4096));
        assert_eq!(align_up(usize::MAX, 2), None);
    }
}
