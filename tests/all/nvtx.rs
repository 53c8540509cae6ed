//! NVTX memory annotations (issue 24): the injection handshake with a fake tool linked
//! into this binary (NVTX's static injection, `cuda::nvtx::inject_static`), which checks
//! every structure it is given and records every call; the pools' heaps and regions
//! balance (CPU: the simulated pool; GPU: `DevicePool` on both backings and
//! `DeviceArena`); the switch and the loading path's failures. The `sanitizer_*` tests
//! make the errors compute-sanitizer must report (run by `tools/gpu-nvtx-checks.sh`,
//! only with `CUDALLOC_SANITIZER_TESTS=1`).
//!
//! Each test that attaches a tool runs alone in a child process: the tool is process-wide
//! and attached once.

use core::ffi::{c_char, c_int, c_void};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use cudalloc::cuda::nvtx::{self, *};
use cudalloc::cuda::{Module, Stream};
use cudalloc::device::sim::{SimPool, SimStream};
use cudalloc::device::{Backing, DeviceArena, DevicePool, DevicePoolConfig};

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
    let module = Module::load_ptx(0, PTX).unwrap();
    let kernel = module.function(KERNEL).unwrap();
    let src = pool.alloc_zeroed::<u32>(n + 2048, stream).unwrap();
    assert_ne!(src.device_ptr(), dst, "the source is not the block under test");
    let (mut i, mut o, mut len, mut rounds) = (src.device_ptr(), dst, n as u64, 1u32);
    // SAFETY: the arguments match pipeline_hash(const u32*, u32*, u64, u32). `dst` may
    // be past a buffer's end or freed on purpose: the memory stays mapped by the pool
    // (rounding, cache, arena chunk), so the write corrupts nothing but the pool's own
    // unused bytes, and the sanitizer is what must notice.
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
        "{KERNEL} writing {n} u32 at {dst:#x}: launch {launched:?}, then {:?}",
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
    let buf = pool.alloc::<u32>(SMALL, &stream).unwrap();
    let ptr = buf.device_ptr();
    drop(buf); // cached: still the pool's memory, no longer the program's
    write_with_kernel(&pool, &stream, ptr, SMALL);
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
