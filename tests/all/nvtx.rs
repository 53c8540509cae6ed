//! NVTX memory annotations (issue 24): the injection handshake with a fake tool linked
//! into this binary (NVTX's static injection, `cuda::nvtx::inject_static`), which checks
//! every structure it is given and records every call; the pools' heaps and regions
//! balance (CPU: the simulated pool, a host `Pool` and `Arena` over memory that says a
//! kernel reaches it; GPU: `DevicePool` on both backings and `DeviceArena`, the pinned
//! and managed handles, pools over each host source and a pinned `Arena`); the switch and
//! the loading path's failures. The `sanitizer_*` tests
//! make the errors compute-sanitizer must report (run by `tools/gpu-nvtx-checks.sh`,
//! only with `CUDALLOC_SANITIZER_TESTS=1`).
//!
//! Each test that attaches a tool runs alone in a child process: the tool is process-wide
//! and attached once.

use core::ffi::{c_char, c_int, c_void};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use core::ptr::NonNull;

use allocator_api2::alloc::{Allocator, Layout};
use allocator_api2::vec::Vec;
use cudalloc::arena::{Arena, ArenaConfig};
use cudalloc::cuda::nvtx::{self, *};
use cudalloc::cuda::HostAllocFlags;
use cudalloc::cuda::{MemoryType, Module, Stream};
use cudalloc::device::sim::{SimPool, SimStream};
use cudalloc::device::{Backing, DeviceArena, DeviceBuffer, DevicePool, DevicePoolConfig};
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::{
    HostSource, HostVisible, ManagedAttach, ManagedSource, MemorySource, PinnedSource, RegisteredSource,
};
use cudalloc::{ManagedAlloc, PinnedAlloc};

use crate::pipeline::{KERNEL, PTX};

// ---- The fake tool ---------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq)]
enum Call {
    Heap { handle: usize, base: u64, size: usize },
    HeapGone { handle: usize },
    Region { heap: usize, ptr: u64, size: usize },
    RegionGone { ptr: u64 },
}

static CALLS: Mutex<Vec<Call>> = Mutex::new(Vec::new());
/// What the fake tool found wrong (a panic cannot cross the C ABI).
static BAD: Mutex<Vec<String>> = Mutex::new(Vec::new());
static CORE_INITIALIZED: AtomicBool = AtomicBool::new(false);
/// The domain the fake tool makes for `cudalloc`: every memory call must pass it.
const DOMAIN: usize = 0xD0_0000;

fn check(ok: bool, what: &str) {
    if !ok {
        BAD.lock().unwrap().push(what.to_string());
    }
}

fn record(c: Call) {
    CALLS.lock().unwrap().push(c);
}

fn calls() -> Vec<Call> {
    CALLS.lock().unwrap().clone()
}

unsafe extern "C" fn fake_domain_create(name: *const c_char) -> *mut c_void {
    // SAFETY: the crate passes a NUL-terminated string.
    let name = unsafe { std::ffi::CStr::from_ptr(name) };
    check(name.to_bytes() == b"cudalloc", "the domain is named cudalloc");
    DOMAIN as *mut c_void
}

unsafe extern "C" fn fake_initialize(reserved: *const c_void) {
    check(reserved.is_null(), "nvtxInitialize(NULL)");
}

/// `InitializeInjectionNvtx2`: reads the export tables as a tool does and writes its
/// `nvtxDomainCreateA` and `nvtxInitialize` into the CORE2 table.
unsafe extern "C" fn fake_core_init(get: GetExportTable) -> c_int {
    CORE_INITIALIZED.store(true, Ordering::SeqCst);
    // SAFETY: the crate's nvtxGetExportTable, called as NVTX documents it.
    let cb = unsafe { get(ETID_CALLBACKS) }.cast::<ExportTableCallbacks>();
    check(!cb.is_null(), "a callbacks export table");
    // SAFETY: as above.
    check(
        !unsafe { get(ETID_VERSIONINFO) }.is_null(),
        "a version export table",
    );
    // SAFETY: as above.
    check(unsafe { get(2) }.is_null(), "no table for a reserved id");
    if cb.is_null() {
        return 0;
    }
    // SAFETY: checked non-null; the table is static.
    let cb = unsafe { &*cb };
    check(
        cb.struct_size == size_of::<ExportTableCallbacks>(),
        "its struct_size",
    );
    let (mut table, mut size) = (core::ptr::null_mut(), 0u32);
    // SAFETY: the table's function with writable outputs.
    let ok = unsafe { (cb.get_module_function_table)(CB_MODULE_CORE2, &mut table, &mut size) };
    check(
        ok == 1 && size == 16 && !table.is_null(),
        "the CORE2 table, of 16 callbacks",
    );
    // SAFETY: as above; module 0 and 7 do not exist.
    check(
        unsafe { (cb.get_module_function_table)(0, &mut table, &mut size) } == 0
            && unsafe { (cb.get_module_function_table)(7, &mut table, &mut size) } == 0,
        "no table for unknown modules",
    );
    // SAFETY: as above.
    unsafe { (cb.get_module_function_table)(CB_MODULE_CORE2, &mut table, &mut size) };
    // SAFETY: entries 1..size are pointers to writable cells; 0 and `size` are null.
    unsafe {
        check(
            (*table).is_null() && (*table.add(size as usize)).is_null(),
            "null ends",
        );
        *(*table.add(CBID_CORE2_DOMAIN_CREATE_A)) = fake_domain_create as *const () as usize;
        *(*table.add(CBID_CORE2_INITIALIZE)) = fake_initialize as *const () as usize;
    }
    1
}

/// `InitializeInjectionNvtxExtension`: checks the memory module and fills its slots.
unsafe extern "C" fn fake_ext_init(m: *mut ExtModuleInfo) -> c_int {
    // SAFETY: the crate passes a valid module.
    let m = unsafe { &mut *m };
    check(
        m.nvtx_ver == 3 && m.module_id == MODULE_ID_MEM && m.compat_id == COMPAT_ID_MEM,
        "module ids",
    );
    check(
        m.struct_size as usize == size_of::<ExtModuleInfo>(),
        "module struct size",
    );
    check(m.segments_count == 1 && !m.segments.is_null(), "one segment");
    // SAFETY: checked above.
    let seg = unsafe { &mut *m.segments };
    // As compute-sanitizer 2025.3.1 does: a module laid out as before NVTX 3.2 (segment 0,
    // 17 slots) gets no function, so the balance test below fails with such a module.
    if seg.segment_id != MEM_SEGMENT_ID || seg.slot_count != MEM_SLOT_COUNT || seg.function_slots.is_null() {
        return 1;
    }
    // SAFETY: MEM_SLOT_COUNT (> the highest id written) writable slots.
    unsafe {
        *seg.function_slots.add(CBID_HEAP_REGISTER) = fake_heap_register as *const () as isize;
        *seg.function_slots.add(CBID_HEAP_UNREGISTER) = fake_heap_unregister as *const () as isize;
        *seg.function_slots.add(CBID_REGIONS_REGISTER) = fake_regions_register as *const () as isize;
        *seg.function_slots.add(CBID_REGIONS_UNREGISTER) = fake_regions_unregister as *const () as isize;
    }
    1
}

unsafe extern "C" fn fake_heap_register(domain: *mut c_void, desc: *const HeapDesc) -> *mut c_void {
    check(domain as usize == DOMAIN, "heap: our domain");
    // SAFETY: the crate passes a valid descriptor.
    let d = unsafe { &*desc };
    check(
        d.ext_compat_id == COMPAT_ID_MEM && d.struct_size as usize == size_of::<HeapDesc>(),
        "heap: compat id and size",
    );
    check(
        d.usage == 1 && d.kind == 1,
        "heap: a sub-allocator of virtual addresses",
    );
    check(
        d.type_specific_desc_size == size_of::<VirtualRangeDesc>(),
        "heap: range size",
    );
    // SAFETY: a VirtualRangeDesc, as the size says.
    let r = unsafe { *d.type_specific_desc.cast::<VirtualRangeDesc>() };
    // As the API says (and compute-sanitizer does): a heap of virtual addresses is named
    // by its base address.
    let handle = r.ptr as usize;
    record(Call::Heap {
        handle,
        base: r.ptr as u64,
        size: r.size,
    });
    handle as *mut c_void
}

unsafe extern "C" fn fake_heap_unregister(domain: *mut c_void, heap: *mut c_void) {
    check(domain as usize == DOMAIN, "heap gone: our domain");
    record(Call::HeapGone {
        handle: heap as usize,
    });
}

unsafe extern "C" fn fake_regions_register(domain: *mut c_void, desc: *const RegionsRegisterBatch) {
    check(domain as usize == DOMAIN, "region: our domain");
    // SAFETY: the crate passes a valid batch.
    let b = unsafe { &*desc };
    check(
        b.ext_compat_id == COMPAT_ID_MEM && b.struct_size as usize == size_of::<RegionsRegisterBatch>(),
        "region: compat id and size",
    );
    check(
        b.region_type == 1 && b.region_count == 1,
        "region: one virtual range",
    );
    check(
        b.region_desc_element_size == size_of::<VirtualRangeDesc>(),
        "region: element size",
    );
    // SAFETY: one VirtualRangeDesc.
    let r = unsafe { *b.region_desc_elements.cast::<VirtualRangeDesc>() };
    record(Call::Region {
        heap: b.heap as usize,
        ptr: r.ptr as u64,
        size: r.size,
    });
}

unsafe extern "C" fn fake_regions_unregister(domain: *mut c_void, desc: *const RegionsUnregisterBatch) {
    check(domain as usize == DOMAIN, "region gone: our domain");
    // SAFETY: the crate passes a valid batch.
    let b = unsafe { &*desc };
    check(
        b.ext_compat_id == COMPAT_ID_MEM && b.struct_size as usize == size_of::<RegionsUnregisterBatch>(),
        "region gone: compat id and size",
    );
    check(b.ref_type == 1 && b.ref_count == 1, "region gone: one pointer");
    // SAFETY: one pointer.
    let p = unsafe { *b.ref_elements };
    record(Call::RegionGone { ptr: p as u64 });
}

/// What the calls leave registered, checked as a tool would: a region lies inside a live
/// heap and is not live already, only live regions and heaps are unregistered.
#[derive(Debug, Default)]
struct Registered {
    heaps: HashMap<usize, (u64, usize)>,
    regions: HashMap<u64, usize>,
}

fn replay(calls: &[Call]) -> Registered {
    let mut r = Registered::default();
    for c in calls {
        match *c {
            Call::Heap { handle, base, size } => {
                assert!(r.heaps.insert(handle, (base, size)).is_none(), "{c:?}");
            }
            Call::HeapGone { handle } => {
                let (base, size) = r
                    .heaps
                    .remove(&handle)
                    .unwrap_or_else(|| panic!("not live: {c:?}"));
                r.regions.retain(|&p, _| !(base..base + size as u64).contains(&p));
            }
            Call::Region { heap, ptr, size } => {
                let &(base, hsize) = r.heaps.get(&heap).unwrap_or_else(|| panic!("no heap: {c:?}"));
                assert!(
                    ptr >= base && ptr + size as u64 <= base + hsize as u64,
                    "outside its heap: {c:?}"
                );
                assert!(r.regions.insert(ptr, size).is_none(), "live twice: {c:?}");
            }
            Call::RegionGone { ptr } => {
                assert!(r.regions.remove(&ptr).is_some(), "not live: {c:?}");
            }
        }
    }
    r
}

fn attach_fake_tool() {
    assert!(nvtx::inject_static(Some(fake_core_init), fake_ext_init));
    assert!(nvtx::attached(), "the fake tool is attached");
    assert!(CORE_INITIALIZED.load(Ordering::SeqCst));
    assert_no_complaints();
}

fn assert_no_complaints() {
    let bad = BAD.lock().unwrap().clone();
    assert!(bad.is_empty(), "the fake tool found: {bad:?}");
}

/// Runs test `name` alone in a child process with a clean NVTX environment plus `env`
/// (a tool of the parent's, compute-sanitizer's, stays out), and returns true; in the
/// child returns false and the caller runs the body.
fn in_a_child(name: &str, env: &[(&str, &str)]) -> bool {
    const CHILD: &str = "CUDALLOC_TEST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        return false;
    }
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--test-threads=1"])
        .env(CHILD, "1")
        .env_remove("NVTX_INJECTION64_PATH")
        .env_remove("CUDALLOC_NVTX");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the test in a child process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} in a child process: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    true
}

// ---- CPU: the protocol and the balance on the simulated pool -----------------------------

#[test]
fn a_simulated_pool_registers_heaps_and_exact_regions_and_balances() {
    if in_a_child(
        "nvtx::a_simulated_pool_registers_heaps_and_exact_regions_and_balances",
        &[],
    ) {
        return;
    }
    attach_fake_tool();
    let s = SimStream::new();
    for thread_cache in [256 << 20, 0] {
        let pool = SimPool::annotated(thread_cache);
        let start = calls().len();
        let a = pool.alloc(4000, &s).unwrap();
        let pa = a.device_ptr();
        let r = replay(&calls());
        assert_eq!(
            r.regions.get(&pa),
            Some(&4000),
            "a live region of the requested length"
        );
        let heap = r
            .heaps
            .values()
            .find(|(b, _)| *b == pa)
            .expect("the block is a heap");
        assert!(heap.1 >= 4000, "{heap:?}");

        drop(a);
        assert_eq!(calls().last(), Some(&Call::RegionGone { ptr: pa }));
        let r = replay(&calls());
        assert!(r.regions.is_empty(), "cached is not live");
        assert_eq!(r.heaps.len(), 1, "the cached block stays a heap");

        let again = pool.alloc(4000, &s).unwrap();
        assert_eq!(again.device_ptr(), pa, "reused from the cache");
        let big = pool.alloc((64 << 20) + 4000, &s).unwrap();
        let r = replay(&calls());
        assert_eq!(r.regions.get(&pa), Some(&4000));
        assert_eq!(r.regions.get(&big.device_ptr()), Some(&((64 << 20) + 4000)));
        let made = calls()[start..]
            .iter()
            .filter(|c| matches!(c, Call::Heap { .. }))
            .count();
        assert_eq!(made, 2, "a hit registers no heap");

        drop((again, big));
        pool.trim();
        let r = replay(&calls());
        assert!(
            r.regions.is_empty() && r.heaps.is_empty(),
            "trim unregisters the heaps: {r:?}"
        );
        let ours = &calls()[start..];
        let count = |f: fn(&Call) -> bool| ours.iter().filter(|c| f(c)).count();
        assert_eq!(
            count(|c| matches!(c, Call::Heap { .. })),
            count(|c| matches!(c, Call::HeapGone { .. }))
        );
        assert_eq!(
            count(|c| matches!(c, Call::Region { .. })),
            count(|c| matches!(c, Call::RegionGone { .. }))
        );
    }
    // A pool without annotations makes no call (the simulator's default, as a
    // `DevicePool` with `with_nvtx(false)`).
    let n = calls().len();
    let plain = SimPool::new(0);
    drop(plain.alloc(4096, &s).unwrap());
    plain.trim();
    assert_eq!(calls().len(), n, "{:?}", &calls()[n..]);
    // The bare pool (the NVTX branch compiled out of its hot path, for measuring it):
    // its backend still makes its blocks heaps, but no block is ever a live region.
    let bare = SimPool::bare(256 << 20);
    let n = calls().len();
    let a = bare.alloc(4000, &s).unwrap();
    let pa = a.device_ptr();
    drop(a);
    let again = bare.alloc(4000, &s).unwrap();
    assert_eq!(again.device_ptr(), pa, "a hit");
    drop(again);
    let ours = &calls()[n..];
    assert!(ours.iter().any(|c| matches!(c, Call::Heap { .. })), "{ours:?}");
    assert!(
        !ours
            .iter()
            .any(|c| matches!(c, Call::Region { .. } | Call::RegionGone { .. })),
        "{ours:?}"
    );
    bare.trim();
    assert_no_complaints();
}

#[test]
fn cudalloc_nvtx_0_keeps_a_tool_out() {
    if in_a_child(
        "nvtx::cudalloc_nvtx_0_keeps_a_tool_out",
        &[("CUDALLOC_NVTX", "0")],
    ) {
        return;
    }
    assert!(nvtx::inject_static(Some(fake_core_init), fake_ext_init));
    assert!(!nvtx::attached());
    let pool = SimPool::annotated(0);
    drop(pool.alloc(4096, &SimStream::new()).unwrap());
    pool.trim();
    assert!(
        !CORE_INITIALIZED.load(Ordering::SeqCst),
        "the tool was never initialized"
    );
    assert!(calls().is_empty(), "{:?}", calls());
}

#[test]
fn an_injection_path_to_nothing_leaves_annotations_off() {
    let path = "/nonexistent/libnvtx-tool.so";
    if in_a_child(
        "nvtx::an_injection_path_to_nothing_leaves_annotations_off",
        &[("NVTX_INJECTION64_PATH", path)],
    ) {
        return;
    }
    assert!(!nvtx::attached());
    drop(SimPool::annotated(0).alloc(4096, &SimStream::new()).unwrap());
}

#[test]
fn an_injection_path_to_a_library_that_is_no_tool_leaves_annotations_off() {
    // libc opens, but has no InitializeInjectionNvtx* entry points.
    if in_a_child(
        "nvtx::an_injection_path_to_a_library_that_is_no_tool_leaves_annotations_off",
        &[("NVTX_INJECTION64_PATH", "libc.so.6")],
    ) {
        return;
    }
    assert!(!nvtx::attached());
    drop(SimPool::annotated(0).alloc(4096, &SimStream::new()).unwrap());
}

#[test]
fn without_a_tool_nothing_is_attached() {
    if std::env::var_os("NVTX_INJECTION64_PATH").is_some() {
        return; // under compute-sanitizer: its tool is attached
    }
    assert!(!nvtx::attached());
    assert!(
        !nvtx::inject_static(Some(fake_core_init), fake_ext_init),
        "too late once looked"
    );
}

// ---- CPU: a host pool and an arena over memory a kernel would reach ----------------------

/// Pageable memory that says the GPU reaches it at its host address, as pinned and managed
/// memory do (`MemorySource::device_mapped`): what the host pools and arenas annotate,
/// without a GPU.
struct Mapped;

// SAFETY: forwards to HostSource, whose promises hold.
unsafe impl MemorySource for Mapped {
    fn align(&self) -> usize {
        HostSource.align()
    }
    fn kind(&self) -> MemoryType {
        MemoryType::PinnedHost
    }
    fn allocate(&self, size: usize) -> cudalloc::Result<NonNull<u8>> {
        HostSource.allocate(size)
    }
    unsafe fn deallocate(&self, ptr: NonNull<u8>, size: usize) {
        // SAFETY: the caller's obligations are HostSource's.
        unsafe { HostSource.deallocate(ptr, size) }
    }
    fn device_mapped(&self, _: NonNull<u8>, _: usize) -> bool {
        true
    }
}
// SAFETY: HostSource's memory.
unsafe impl HostVisible for Mapped {}

/// What the calls since `start` registered and unregistered: (heaps, heaps gone,
/// regions, regions gone).
fn counts(start: usize) -> (usize, usize, usize, usize) {
    let c = calls();
    let n = |f: fn(&Call) -> bool| c[start..].iter().filter(|c| f(c)).count();
    (
        n(|c| matches!(c, Call::Heap { .. })),
        n(|c| matches!(c, Call::HeapGone { .. })),
        n(|c| matches!(c, Call::Region { .. })),
        n(|c| matches!(c, Call::RegionGone { .. })),
    )
}

fn heap_holding(r: &Registered, p: u64) -> Option<(u64, usize)> {
    r.heaps
        .values()
        .copied()
        .find(|&(b, size)| (b..b + size as u64).contains(&p))
}

#[test]
fn a_host_pool_over_mapped_memory_registers_heaps_and_exact_regions_and_balances() {
    if in_a_child(
        "nvtx::a_host_pool_over_mapped_memory_registers_heaps_and_exact_regions_and_balances",
        &[],
    ) {
        return;
    }
    attach_fake_tool();
    for config in [
        PoolConfig::default(),
        PoolConfig::default().with_thread_cache_capacity(0),
    ] {
        let start = calls().len();
        let pool = Pool::with_config(Mapped, config);
        let small = pool.allocate(Layout::from_size_align(1000, 8).unwrap()).unwrap();
        let mut v: Vec<u32, &Pool<Mapped>> = Vec::with_capacity_in(1000, &pool);
        v.push(7);
        let large = pool
            .allocate(Layout::from_size_align((600 << 10) + 5, 8).unwrap())
            .unwrap();
        let (ps, pv, pl) = (addr(small), v.as_ptr() as u64, addr(large));
        let r = replay(&calls());
        assert_eq!(
            r.regions.get(&ps),
            Some(&1000),
            "exactly the request, not its class"
        );
        assert_eq!(r.regions.get(&pv), Some(&4000));
        assert_eq!(
            r.regions.get(&pl),
            Some(&((600 << 10) + 5)),
            "not its page rounding"
        );
        assert_eq!(r.regions.len(), 3, "{r:?}");
        assert!(
            heap_holding(&r, ps).is_some() && heap_holding(&r, pl).is_some(),
            "{r:?}"
        );
        let heaps = r.heaps.len();

        // A zero-size block is no region.
        let n = calls().len();
        let empty = pool.allocate(Layout::from_size_align(0, 8).unwrap()).unwrap();
        // SAFETY: allocated just above with this layout.
        unsafe { pool.deallocate(empty.cast(), Layout::from_size_align(0, 8).unwrap()) };
        assert_eq!(calls().len(), n, "{:?}", &calls()[n..]);

        // Resized in place (same class): a region of the new length.
        let old = Layout::from_size_align(1000, 8).unwrap();
        let new = Layout::from_size_align(1010, 8).unwrap();
        // SAFETY: `small` was allocated with `old`, and is not used after.
        let grown = unsafe { pool.grow(small.cast(), old, new) }.unwrap();
        assert_eq!(addr(grown), ps, "same class: in place");
        assert_eq!(replay(&calls()).regions.get(&ps), Some(&1010));

        // Freed: to the thread cache or a shared list, no longer live; the chunk stays a heap.
        // SAFETY: allocated (grown) with `new`, not used after.
        unsafe { pool.deallocate(grown.cast(), new) };
        drop(v);
        let r = replay(&calls());
        assert!(
            !r.regions.contains_key(&ps) && !r.regions.contains_key(&pv),
            "{r:?}"
        );
        assert_eq!(r.heaps.len(), heaps, "cached memory stays a heap");
        // Reused from the cache: live again, at the new request's length.
        let again = pool.allocate(Layout::from_size_align(999, 8).unwrap()).unwrap();
        assert_eq!(replay(&calls()).regions.get(&addr(again)), Some(&999));
        // SAFETY: allocated just above with this layout.
        unsafe { pool.deallocate(again.cast(), Layout::from_size_align(999, 8).unwrap()) };
        // SAFETY: as above.
        unsafe { pool.deallocate(large.cast(), Layout::from_size_align((600 << 10) + 5, 8).unwrap()) };

        // Trim gives every heap back.
        pool.trim();
        let r = replay(&calls());
        assert!(r.heaps.is_empty() && r.regions.is_empty(), "trimmed: {r:?}");
        let (h, hg, rg, rgg) = counts(start);
        assert_eq!((h, rg), (hg, rgg), "balanced: {:?}", &calls()[start..]);
        assert!(h >= 2 && rg >= 5, "{h} heaps, {rg} regions");

        // Dropped without a trim: its heaps go too.
        let start = calls().len();
        let b = pool.allocate(Layout::from_size_align(64, 8).unwrap()).unwrap();
        // SAFETY: allocated just above with this layout.
        unsafe { pool.deallocate(b.cast(), Layout::from_size_align(64, 8).unwrap()) };
        drop(pool);
        let (h, hg, rg, rgg) = counts(start);
        assert_eq!((h, hg, rg, rgg), (1, 1, 1, 1), "{:?}", &calls()[start..]);
        assert!(replay(&calls()).heaps.is_empty());
    }
    // Pageable memory (HostSource, the fallback without a driver), and a pool configured
    // without annotations: no call.
    let n = calls().len();
    let plain = Pool::new(HostSource);
    let mut v: Vec<u32, &Pool<HostSource>> = Vec::with_capacity_in(1000, &plain);
    v.push(1);
    drop(v);
    plain.trim();
    let off = Pool::with_config(Mapped, PoolConfig::default().with_nvtx(false));
    let mut v: Vec<u32, &Pool<Mapped>> = Vec::with_capacity_in(1000, &off);
    v.push(1);
    drop(v);
    off.trim();
    assert_eq!(calls().len(), n, "{:?}", &calls()[n..]);
    assert_no_complaints();
}

#[test]
fn a_host_arena_over_mapped_memory_registers_exact_regions_and_resets_to_none() {
    if in_a_child(
        "nvtx::a_host_arena_over_mapped_memory_registers_exact_regions_and_resets_to_none",
        &[],
    ) {
        return;
    }
    attach_fake_tool();
    let start = calls().len();
    let mut arena = Arena::with_config(Mapped, ArenaConfig::pinned());
    {
        let a = arena
            .try_alloc_layout(Layout::from_size_align(100, 8).unwrap())
            .unwrap();
        let pa = a.as_ptr() as u64;
        let r = replay(&calls());
        assert_eq!(r.regions.get(&pa), Some(&100), "{r:?}");
        assert_eq!(r.heaps.len(), 1, "the chunk is a heap: {r:?}");
        assert_eq!(heap_holding(&r, pa).map(|h| h.1), Some(2 << 20));

        // A Vec growing in place (the newest block): one live region, of its capacity.
        let mut v: Vec<u32, &Arena<Mapped>> = Vec::new_in(&arena);
        v.extend(0..1000);
        let r = replay(&calls());
        let pv = v.as_ptr() as u64;
        assert_eq!(r.regions.get(&pv), Some(&(v.capacity() * 4)), "{r:?}");
        assert_eq!(r.regions.len(), 2, "the moves left no region behind: {r:?}");
        drop(v);
        assert!(!replay(&calls()).regions.contains_key(&pv), "freed");

        // A Vec that is not the newest block moves when it grows: the new block is a
        // region, the old one no longer.
        let mut w: Vec<u32, &Arena<Mapped>> = Vec::with_capacity_in(10, &arena);
        w.extend(0..10);
        let old = w.as_ptr() as u64;
        let x = arena
            .try_alloc_layout(Layout::from_size_align(16, 8).unwrap())
            .unwrap();
        w.extend(10..100);
        let r = replay(&calls());
        assert_ne!(w.as_ptr() as u64, old, "moved");
        assert!(!r.regions.contains_key(&old), "{r:?}");
        assert_eq!(r.regions.get(&(w.as_ptr() as u64)), Some(&(w.capacity() * 4)));
        assert_eq!(r.regions.get(&(x.as_ptr() as u64)), Some(&16));
        drop(w);
        // SAFETY: `x` is the arena's block of this layout, not used after.
        unsafe { (&arena).deallocate(x, Layout::from_size_align(16, 8).unwrap()) };
        assert_eq!(replay(&calls()).regions.len(), 1, "only `a` is live");

        // A rewind takes the regions after its checkpoint, not those before.
        let mark = arena.checkpoint();
        let c = arena
            .try_alloc_layout(Layout::from_size_align(24, 8).unwrap())
            .unwrap();
        let d = arena
            .try_alloc_layout(Layout::from_size_align(40, 8).unwrap())
            .unwrap();
        let (pc, pd) = (c.as_ptr() as u64, d.as_ptr() as u64);
        // SAFETY: `d` is the arena's block of this layout, not used after.
        unsafe { (&arena).deallocate(d, Layout::from_size_align(40, 8).unwrap()) };
        let e = arena
            .try_alloc_layout(Layout::from_size_align(40, 8).unwrap())
            .unwrap();
        assert_eq!(e.as_ptr() as u64, pd, "the freed newest block's place");
        let r = replay(&calls());
        assert_eq!((r.regions.get(&pc), r.regions.get(&pd)), (Some(&24), Some(&40)));
        arena.rewind(mark);
        let r = replay(&calls());
        assert!(
            !r.regions.contains_key(&pc) && !r.regions.contains_key(&pd),
            "{r:?}"
        );
        assert_eq!(r.regions.get(&pa), Some(&100), "before the mark: live");
    }
    // A dedicated chunk for a big block is a heap of its own.
    let big = arena
        .try_alloc_layout(Layout::from_size_align(3 << 20, 8).unwrap())
        .unwrap();
    let r = replay(&calls());
    assert_eq!(r.regions.get(&(big.as_ptr() as u64)), Some(&(3 << 20)));
    assert_eq!(r.heaps.len(), 2, "{r:?}");

    arena.reset();
    let r = replay(&calls());
    assert!(r.regions.is_empty(), "reset: no live region: {r:?}");
    assert_eq!(r.heaps.len(), 1, "the kept chunk stays a heap");
    let f = arena
        .try_alloc_layout(Layout::from_size_align(8, 8).unwrap())
        .unwrap();
    assert_eq!(replay(&calls()).regions.get(&(f.as_ptr() as u64)), Some(&8));
    drop(arena);
    let r = replay(&calls());
    assert!(r.heaps.is_empty() && r.regions.is_empty(), "dropped: {r:?}");
    let (h, hg, rg, rgg) = counts(start);
    assert_eq!((h, rg), (hg, rgg), "balanced: {:?}", &calls()[start..]);

    // Pageable memory, and an arena configured without annotations: no call.
    let n = calls().len();
    let mut plain = Arena::host();
    plain
        .try_alloc_layout(Layout::from_size_align(100, 8).unwrap())
        .unwrap();
    plain.reset();
    drop(plain);
    let mut off = Arena::with_config(Mapped, ArenaConfig::pinned().with_nvtx(false));
    off.try_alloc_layout(Layout::from_size_align(100, 8).unwrap())
        .unwrap();
    off.reset();
    drop(off);
    assert_eq!(calls().len(), n, "{:?}", &calls()[n..]);
    assert_no_complaints();
}

fn addr(block: NonNull<[u8]>) -> u64 {
    block.cast::<u8>().as_ptr() as u64
}

// ---- GPU: DevicePool (both backings) and DeviceArena with the fake tool -----------------

#[test]
fn device_pools_and_arenas_register_exact_regions_and_balance() {
    gpu!();
    if in_a_child(
        "nvtx::device_pools_and_arenas_register_exact_regions_and_balance",
        &[],
    ) {
        return;
    }
    attach_fake_tool();
    let stream = Stream::new(0).unwrap();
    let mut backings = vec![Backing::DriverPool];
    if DevicePool::new(0, DevicePoolConfig::default())
        .unwrap()
        .config()
        .backing
        == Backing::PhysicalPages
    {
        backings.push(Backing::PhysicalPages);
    }
    for backing in backings {
        let pool = DevicePool::new(0, DevicePoolConfig::default().with_backing(backing)).unwrap();
        let small = pool.alloc::<u32>(1000, &stream).unwrap();
        let large = pool.alloc::<u32>((1 << 20) + 1000, &stream).unwrap();
        let r = replay(&calls());
        assert_eq!(r.regions.get(&small.device_ptr()), Some(&4000), "{backing:?}");
        assert_eq!(
            r.regions.get(&large.device_ptr()),
            Some(&((4 << 20) + 4000)),
            "{backing:?}"
        );
        let (ps, pl) = (small.device_ptr(), large.device_ptr());
        drop((small, large));
        let r = replay(&calls());
        assert!(
            !r.regions.contains_key(&ps) && !r.regions.contains_key(&pl),
            "{backing:?}"
        );

        let mut arena = DeviceArena::new(&pool, &stream).unwrap();
        let (a, b) = (arena.alloc::<u32>(1000).unwrap(), arena.alloc::<u8>(10).unwrap());
        let (pa, pb) = (a.device_ptr(), b.device_ptr());
        let r = replay(&calls());
        assert_eq!(r.regions.get(&pa), Some(&4000), "a slice's region: {backing:?}");
        assert_eq!(r.regions.get(&pb), Some(&10));
        assert_eq!(
            r.regions.len(),
            2,
            "the chunk itself is not live: {:?}",
            r.regions
        );
        // The slices are gone on the host; their regions stay live until a reset or a rewind.
        assert_eq!(replay(&calls()).regions.len(), 2);
        let mark = arena.checkpoint();
        let c = arena.alloc::<u32>(7).unwrap();
        let pc = c.device_ptr();
        arena.rewind(mark).unwrap();
        let r = replay(&calls());
        assert!(
            !r.regions.contains_key(&pc) && r.regions.contains_key(&pa),
            "rewound: {r:?}"
        );
        arena.reset();
        assert!(replay(&calls()).regions.is_empty(), "reset: no live region");
        let d = arena.alloc::<u32>(1000).unwrap();
        assert_eq!(replay(&calls()).regions.get(&d.device_ptr()), Some(&4000));
        drop(arena);
        assert!(
            replay(&calls()).regions.is_empty(),
            "a dropped arena: no live region"
        );

        stream.synchronize().unwrap();
        pool.trim();
        drop(pool);
        let r = replay(&calls());
        assert!(r.heaps.is_empty() && r.regions.is_empty(), "{backing:?}: {r:?}");
    }
    // A pool configured without annotations makes no call.
    let n = calls().len();
    let off = DevicePool::new(0, DevicePoolConfig::default().with_nvtx(false)).unwrap();
    drop(off.alloc::<u32>(1000, &stream).unwrap());
    drop(off.alloc::<u32>((1 << 20) + 1000, &stream).unwrap());
    stream.synchronize().unwrap();
    off.trim();
    assert_eq!(calls().len(), n, "{:?}", &calls()[n..]);
    assert_no_complaints();
}

// ---- GPU: the pinned and managed pools and arenas with the fake tool --------------------

/// Whether the driver maps the host block at `p` into the device at the same address
/// (what makes a host pool's chunk an NVTX heap).
fn mapped_at_its_address(p: u64) -> bool {
    cudalloc::cuda::pointer_info(p as *const u8).is_ok_and(|i| i.device_pointer == Some(p))
}

/// Whether a block straight from `source` is mapped into the device at its address.
fn source_maps<S: MemorySource>(source: &S) -> bool {
    let p = source.allocate(1 << 20).unwrap();
    let mapped = mapped_at_its_address(p.as_ptr() as u64);
    // SAFETY: allocated just above with this size, never used.
    unsafe { source.deallocate(p, 1 << 20) };
    mapped
}

/// A `Vec` of 1000 `u32` from `pool` is a live region of 4000 bytes if `heap` (else
/// nothing), and freed no longer; trimmed, the pool holds no heap.
fn check_host_pool<S: HostVisible + 'static>(name: &str, pool: &Pool<S>, heap: bool) {
    let start = calls().len();
    let mut v: Vec<u32, &Pool<S>> = Vec::with_capacity_in(1000, pool);
    v.push(1);
    let p = v.as_ptr() as u64;
    let r = replay(&calls());
    println!(
        "{name}: block {p:#x}, mapped at its address: {}, heap {:?}",
        mapped_at_its_address(p),
        heap_holding(&r, p)
    );
    assert_eq!(r.regions.get(&p), heap.then_some(&4000), "{name}: {r:?}");
    assert_eq!(heap_holding(&r, p).is_some(), heap, "{name}");
    drop(v);
    assert!(!replay(&calls()).regions.contains_key(&p), "{name}: freed");
    pool.trim();
    let r = replay(&calls());
    assert!(
        heap_holding(&r, p).is_none() && r.regions.is_empty(),
        "{name}: {r:?}"
    );
    let (h, hg, rg, rgg) = counts(start);
    assert_eq!((h, rg), (hg, rgg), "{name} balanced: {:?}", &calls()[start..]);
}

#[test]
fn pinned_and_managed_pools_and_arenas_register_exact_regions_and_balance() {
    gpu!();
    if in_a_child(
        "nvtx::pinned_and_managed_pools_and_arenas_register_exact_regions_and_balance",
        &[],
    ) {
        return;
    }
    attach_fake_tool();
    let start = calls().len();
    // The handles' process-wide pools. Managed memory is reached at its address;
    // `PinnedAlloc`'s chunks (registered memory below 64 MiB by default) are heaps where
    // the device reaches registered memory at its host address.
    let mut p: Vec<u32, PinnedAlloc> = Vec::with_capacity_in(1000, PinnedAlloc);
    let mut m: Vec<u32, ManagedAlloc> = Vec::with_capacity_in(1000, ManagedAlloc);
    p.push(1);
    m.push(1);
    let (pp, pm) = (p.as_ptr() as u64, m.as_ptr() as u64);
    let r = replay(&calls());
    println!(
        "PinnedAlloc block {pp:#x}: mapped at its address: {}",
        mapped_at_its_address(pp)
    );
    assert!(mapped_at_its_address(pm), "managed memory");
    assert_eq!(r.regions.get(&pm), Some(&4000), "ManagedAlloc: {r:?}");
    assert_eq!(
        r.regions.get(&pp),
        mapped_at_its_address(pp).then_some(&4000),
        "PinnedAlloc: {r:?}"
    );
    drop((p, m));
    let r = replay(&calls());
    assert!(
        !r.regions.contains_key(&pp) && !r.regions.contains_key(&pm),
        "{r:?}"
    );
    cudalloc::release_cached_memory();
    let r = replay(&calls());
    assert!(r.heaps.is_empty() && r.regions.is_empty(), "released: {r:?}");

    // Pools over each source: cuMemHostAlloc memory with DEVICEMAP and managed memory
    // (mapped at their address), and where the driver says so, cuMemHostAlloc memory
    // without DEVICEMAP (mapped too under unified addressing) and registered memory.
    check_host_pool(
        "Pool<PinnedSource(DEVICE_MAP)>",
        &Pool::new(PinnedSource::new(HostAllocFlags::DEVICE_MAP)),
        true,
    );
    check_host_pool(
        "Pool<ManagedSource>",
        &Pool::new(ManagedSource::new(ManagedAttach::Global)),
        true,
    );
    let plain = PinnedSource::default();
    check_host_pool("Pool<PinnedSource>", &Pool::new(plain), source_maps(&plain));
    let registered = RegisteredSource::new(true);
    check_host_pool(
        "Pool<RegisteredSource(DEVICEMAP)>",
        &Pool::new(registered),
        source_maps(&registered),
    );

    // An arena of pinned memory: its slices are regions until the reset; dropped, no heap.
    let mut arena = Arena::with_config(
        PinnedSource::new(HostAllocFlags::DEVICE_MAP),
        ArenaConfig::pinned(),
    );
    let a = arena
        .try_alloc_layout(Layout::from_size_align(4000, 256).unwrap())
        .unwrap();
    let pa = a.as_ptr() as u64;
    let r = replay(&calls());
    assert_eq!(r.regions.get(&pa), Some(&4000), "Arena: {r:?}");
    assert_eq!(
        heap_holding(&r, pa).map(|h| h.1),
        Some(2 << 20),
        "its chunk: {r:?}"
    );
    arena.reset();
    assert!(replay(&calls()).regions.is_empty(), "reset: no live region");
    drop(arena);
    let r = replay(&calls());
    assert!(r.heaps.is_empty() && r.regions.is_empty(), "dropped: {r:?}");

    let (h, hg, rg, rgg) = counts(start);
    assert_eq!((h, rg), (hg, rgg), "balanced: {:?}", &calls()[start..]);
    assert!(h >= 4, "{h} heaps");
    assert_no_complaints();
}

// ---- GPU, under compute-sanitizer: the errors it must now report ------------------------

/// Only under `tools/gpu-nvtx-checks.sh` (which sets `CUDALLOC_SANITIZER_TESTS=1` and
/// runs each under compute-sanitizer): these tests make memory errors on purpose.
macro_rules! sanitizer_test {
    () => {
        if std::env::var_os("CUDALLOC_SANITIZER_TESTS").is_none() {
            println!("skipped: makes memory errors on purpose; run by tools/gpu-nvtx-checks.sh");
            return;
        }
        gpu!();
        println!(
            "NVTX_INJECTION64_PATH={:?}; tool: {}",
            std::env::var_os("NVTX_INJECTION64_PATH"),
            cudalloc::cuda::nvtx::status()
        );
    };
}

/// Writes `n` elements at `dst` with the pipeline kernel (`pipeline_hash`: reads a
/// zeroed source of its own, writes `dst[0..n]`). The source is longer than `n` (it reads
/// `n`), so that it is of another size class than the block under test and never reuses
/// a dropped one.
fn write_with_kernel(pool: &DevicePool, stream: &Stream, dst: u64, n: usize) {
    write_from(&source(pool, stream, n), stream, dst, n);
}

/// The zeroed source `write_with_kernel` reads, for `n` elements.
fn source(pool: &DevicePool, stream: &Stream, n: usize) -> DeviceBuffer<u32> {
    pool.alloc_zeroed::<u32>(n + 2048, stream).unwrap()
}

/// `write_with_kernel` from a source taken earlier: a test whose block under test is
/// freed takes the source before the free, since a miss of another class may give an
/// idle cached block back to the driver (the cache's idle allowance), which can hand its
/// address out again at once.
fn write_from(src: &DeviceBuffer<u32>, stream: &Stream, dst: u64, n: usize) {
    assert_ne!(src.device_ptr(), dst, "the source is not the block under test");
    hash_kernel(stream, src.device_ptr(), dst, n, "writing", dst);
}

/// Reads `n` elements at `src` with the pipeline kernel into a zeroed block of its own
/// (longer, so of another size class than the block under test): for initcheck, which
/// reports reads of bytes no one wrote.
fn read_with_kernel(pool: &DevicePool, stream: &Stream, src: u64, n: usize) {
    let dst = pool.alloc_zeroed::<u32>(n + 2048, stream).unwrap();
    assert_ne!(
        dst.device_ptr(),
        src,
        "the destination is not the block under test"
    );
    hash_kernel(stream, src, dst.device_ptr(), n, "reading", src);
}

/// `pipeline_hash(src, dst, n, 1)` on `stream`, then a synchronize; prints what it did
/// (`what` at `at`: the line tools/gpu-nvtx-checks.sh looks for).
fn hash_kernel(stream: &Stream, src: u64, dst: u64, n: usize, what: &str, at: u64) {
    let module = Module::load_ptx(0, PTX).unwrap();
    let kernel = module.function(KERNEL).unwrap();
    let (mut i, mut o, mut len, mut rounds) = (src, dst, n as u64, 1u32);
    // SAFETY: the arguments match pipeline_hash(const u32*, u32*, u64, u32). The block
    // under test may be past a buffer's end, freed or never written on purpose: the
    // memory stays mapped by the pool (rounding, cache, arena chunk), so the access
    // corrupts nothing but the pool's own unused bytes, and the sanitizer is what must
    // notice.
    let launched = unsafe {
        kernel.launch(
            (7, 1, 1),
            (128, 1, 1),
            0,
            stream,
            &mut [
                (&mut i as *mut u64).cast(),
                (&mut o as *mut u64).cast(),
                (&mut len as *mut u64).cast(),
                (&mut rounds as *mut u32).cast(),
            ],
        )
    };
    println!(
        "{KERNEL} {what} {n} u32 at {at:#x}: launch {launched:?}, then {:?}",
        stream.synchronize()
    );
}

fn sanitizer_pool(backing: Backing) -> DevicePool {
    let pool = DevicePool::new(0, DevicePoolConfig::default().with_backing(backing)).unwrap();
    assert_eq!(pool.config().backing, backing, "this device has no {backing:?}");
    pool
}

// Requests of 4000 + k * 4 MiB bytes, written 24 u32 (96 bytes) past their end: up to
// the next multiple of 256 bytes, inside the block every backing rounds to (so without
// annotations the write lands in memory the sanitizer sees as allocated).
const SMALL: usize = 1000;
const LARGE: usize = (1 << 20) + 1000;
const PAST: usize = 24;

#[test]
fn sanitizer_write_past_a_small_pooled_buffer() {
    sanitizer_test!();
    let (pool, stream) = (sanitizer_pool(Backing::DriverPool), Stream::new(0).unwrap());
    let buf = pool.alloc::<u32>(SMALL, &stream).unwrap();
    write_with_kernel(&pool, &stream, buf.device_ptr(), SMALL + PAST);
}

#[test]
fn sanitizer_write_past_a_large_page_backed_buffer() {
    sanitizer_test!();
    let (pool, stream) = (sanitizer_pool(Backing::PhysicalPages), Stream::new(0).unwrap());
    let buf = pool.alloc::<u32>(LARGE, &stream).unwrap();
    write_with_kernel(&pool, &stream, buf.device_ptr(), LARGE + PAST);
}

#[test]
fn sanitizer_write_past_a_large_driver_pool_buffer() {
    sanitizer_test!();
    let (pool, stream) = (sanitizer_pool(Backing::DriverPool), Stream::new(0).unwrap());
    let buf = pool.alloc::<u32>(LARGE, &stream).unwrap();
    write_with_kernel(&pool, &stream, buf.device_ptr(), LARGE + PAST);
}

#[test]
fn sanitizer_write_into_a_dropped_buffer() {
    sanitizer_test!();
    let (pool, stream) = (sanitizer_pool(Backing::DriverPool), Stream::new(0).unwrap());
    let src = source(&pool, &stream, SMALL);
    let buf = pool.alloc::<u32>(SMALL, &stream).unwrap();
    let ptr = buf.device_ptr();
    drop(buf); // cached: still the pool's memory, no longer the program's
    write_from(&src, &stream, ptr, SMALL);
}

#[test]
fn sanitizer_write_past_an_arena_slice() {
    sanitizer_test!();
    let (pool, stream) = (sanitizer_pool(Backing::DriverPool), Stream::new(0).unwrap());
    let arena = DeviceArena::new(&pool, &stream).unwrap();
    let slice = arena.alloc::<u32>(SMALL).unwrap();
    write_with_kernel(&pool, &stream, slice.device_ptr(), SMALL + PAST);
}

#[test]
fn sanitizer_write_into_an_arena_after_reset() {
    sanitizer_test!();
    let (pool, stream) = (sanitizer_pool(Backing::DriverPool), Stream::new(0).unwrap());
    let mut arena = DeviceArena::new(&pool, &stream).unwrap();
    let ptr = arena.alloc::<u32>(SMALL).unwrap().device_ptr();
    arena.reset();
    write_with_kernel(&pool, &stream, ptr, SMALL);
}

// ---- initcheck: reads of pooled bytes no one wrote ---------------------------------------
// Run by tools/gpu-nvtx-checks.sh under `--tool initcheck`, annotations on and off.

#[test]
fn initcheck_read_of_a_fresh_pooled_block() {
    sanitizer_test!();
    let (pool, stream) = (sanitizer_pool(Backing::DriverPool), Stream::new(0).unwrap());
    let buf = pool.alloc::<u32>(SMALL, &stream).unwrap();
    read_with_kernel(&pool, &stream, buf.device_ptr(), SMALL);
}

#[test]
fn initcheck_read_of_a_recycled_block_its_last_owner_wrote() {
    sanitizer_test!();
    let (pool, stream) = (sanitizer_pool(Backing::DriverPool), Stream::new(0).unwrap());
    let first = pool.alloc_zeroed::<u32>(SMALL, &stream).unwrap();
    let ptr = first.device_ptr();
    drop(first); // cached: the next buffer of its class on this stream is this block
    let again = pool.alloc::<u32>(SMALL, &stream).unwrap();
    assert_eq!(again.device_ptr(), ptr, "the cache hands the block out again");
    read_with_kernel(&pool, &stream, ptr, SMALL);
}

// ---- The same for host memory: pinned and managed pools and arenas ----------------------

/// A device pool for the kernel's zeroed source (a region of its own, never the block
/// under test) and a stream.
fn kernel_side() -> (DevicePool, Stream) {
    (
        DevicePool::new(0, DevicePoolConfig::default()).unwrap(),
        Stream::new(0).unwrap(),
    )
}

/// Prints whether the host block at `p` is an NVTX heap's (the script reads the line: a
/// host block the tool took no heap for is not checked, see tools/gpu-nvtx-checks.sh).
fn print_host_heap(what: &str, p: *const u32) {
    let p = p as u64;
    println!(
        "{what} at {p:#x}: mapped at its address: {}; nvtx heap: {:?}",
        mapped_at_its_address(p),
        nvtx::heap_holding(p)
    );
}

/// A pool of device-mapped pinned memory (cuMemHostAlloc with DEVICEMAP), as the
/// sanitizer was measured to take as a heap (`tools/nvtx-reference/`, kind `pinned`).
fn mapped_pinned_pool() -> Pool<PinnedSource> {
    Pool::new(PinnedSource::new(HostAllocFlags::DEVICE_MAP))
}

#[test]
fn sanitizer_write_past_a_pinned_pool_vec() {
    sanitizer_test!();
    let (dev, stream) = kernel_side();
    let host = mapped_pinned_pool();
    // 4000 bytes in a block of 4096: the write ends inside the block.
    let v: Vec<u32, &Pool<PinnedSource>> = Vec::with_capacity_in(SMALL, &host);
    print_host_heap("pinned Vec", v.as_ptr());
    write_with_kernel(&dev, &stream, v.as_ptr() as u64, SMALL + PAST);
}

#[test]
fn sanitizer_write_past_a_large_pinned_pool_vec() {
    sanitizer_test!();
    let (dev, stream) = kernel_side();
    let host = mapped_pinned_pool();
    // A segment of the page-rounded request (4 MiB + 4096 bytes): the write ends inside.
    let v: Vec<u32, &Pool<PinnedSource>> = Vec::with_capacity_in(LARGE, &host);
    print_host_heap("large pinned Vec", v.as_ptr());
    write_with_kernel(&dev, &stream, v.as_ptr() as u64, LARGE + PAST);
}

#[test]
fn sanitizer_write_into_a_freed_pinned_block() {
    sanitizer_test!();
    let (dev, stream) = kernel_side();
    let host = mapped_pinned_pool();
    let v: Vec<u32, &Pool<PinnedSource>> = Vec::with_capacity_in(SMALL, &host);
    let p = v.as_ptr();
    print_host_heap("pinned Vec", p);
    drop(v); // cached: still the pool's memory, no longer the program's
    write_with_kernel(&dev, &stream, p as u64, SMALL);
}

#[test]
fn sanitizer_write_past_a_managed_vec() {
    sanitizer_test!();
    let (dev, stream) = kernel_side();
    let v: Vec<u32, ManagedAlloc> = Vec::with_capacity_in(SMALL, ManagedAlloc);
    print_host_heap("managed Vec", v.as_ptr());
    write_with_kernel(&dev, &stream, v.as_ptr() as u64, SMALL + PAST);
}

#[test]
fn sanitizer_write_into_a_freed_managed_block() {
    sanitizer_test!();
    let (dev, stream) = kernel_side();
    let v: Vec<u32, ManagedAlloc> = Vec::with_capacity_in(SMALL, ManagedAlloc);
    let p = v.as_ptr();
    print_host_heap("managed Vec", p);
    drop(v);
    write_with_kernel(&dev, &stream, p as u64, SMALL);
}

#[test]
fn sanitizer_write_past_a_pinned_arena_block() {
    sanitizer_test!();
    let (dev, stream) = kernel_side();
    let arena = Arena::with_config(
        PinnedSource::new(HostAllocFlags::DEVICE_MAP),
        ArenaConfig::pinned(),
    );
    // The first block, bumped down from the chunk's end to a 4096-byte boundary: its
    // 4000 bytes leave 96 before the end, which the write reaches and the chunk holds.
    let p = arena
        .try_alloc_layout(Layout::from_size_align(SMALL * 4, 4096).unwrap())
        .unwrap()
        .as_ptr()
        .cast::<u32>();
    print_host_heap("pinned arena block", p);
    write_with_kernel(&dev, &stream, p as u64, SMALL + PAST);
}

#[test]
fn sanitizer_write_into_a_pinned_arena_after_reset() {
    sanitizer_test!();
    let (dev, stream) = kernel_side();
    let mut arena = Arena::with_config(
        PinnedSource::new(HostAllocFlags::DEVICE_MAP),
        ArenaConfig::pinned(),
    );
    let p = arena
        .try_alloc_layout(Layout::from_size_align(SMALL * 4, 256).unwrap())
        .unwrap()
        .as_ptr()
        .cast::<u32>();
    print_host_heap("pinned arena block", p);
    arena.reset(); // the chunk is kept: the arena's memory, no longer the program's
    write_with_kernel(&dev, &stream, p as u64, SMALL);
}

/// `PinnedAlloc` as configured (`CUDALLOC_PINNED_GROWTH`: by default its chunks are
/// registered memory, with `hostalloc` cuMemHostAlloc memory without DEVICEMAP), neither
/// measured yet: tools/gpu-nvtx-checks.sh reads the heap line and checks the report only
/// if the tool took the heap.
#[test]
fn sanitizer_write_past_a_pinned_alloc_vec() {
    sanitizer_test!();
    let (dev, stream) = kernel_side();
    let v: Vec<u32, PinnedAlloc> = Vec::with_capacity_in(SMALL, PinnedAlloc);
    print_host_heap("PinnedAlloc Vec", v.as_ptr());
    write_with_kernel(&dev, &stream, v.as_ptr() as u64, SMALL + PAST);
}
