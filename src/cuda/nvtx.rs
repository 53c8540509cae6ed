//! NVTX v3 memory annotations, so that compute-sanitizer (and any NVTX tool) sees inside
//! the pools: each block a pool takes from the driver is a *heap*, each block it hands
//! out a live *region* of exactly the requested length, and memory outside live regions
//! (cached, freed, reset, the rounding past a request) is off limits to kernels.
//!
//! No C toolkit: this is NVTX's injection handshake written in Rust, following NVIDIA's
//! headers (github.com/NVIDIA/NVTX, `c/include/nvtx3`, Apache-2.0 WITH LLVM-exception;
//! the line numbers below are of commit bf31d78 on the `dev` branch). A tool announces
//! itself with `NVTX_INJECTION64_PATH` (compute-sanitizer sets it); at the first
//! annotation the library there is opened and given
//! 1. NVTX core's export table (`InitializeInjectionNvtx2(nvtxGetExportTable)`,
//!    `nvtxDetail/nvtxInit.h` 111 and 271, tables as `nvtxDetail/nvtxImpl.h` 371-425), so
//!    the tool attaches as to any NVTX client and creates our domain (`cudalloc`), then
//! 2. the memory extension's module (`InitializeInjectionNvtxExtension(&moduleInfo)`,
//!    `nvtxDetail/nvtxExtInit.h` 124 and 348), whose function slots the tool fills. The
//!    module is laid out as NVTX 3.2's `nvtxDetail/nvtxExtImplMem_v1.h` (the headers of
//!    CUDA 13.0) lays it out: one segment with id 1 and 63 slots, the functions numbered
//!    from 0. compute-sanitizer 2025.3.1 fills no slot of a module laid out as the older
//!    headers did (segment 0, 17 slots, numbered from 1: what this module sent until
//!    2026-12-02, and why the sanitizer saw nothing); `tools/nvtx-reference/` holds the C
//!    probes and the logging shim that found it.
//!
//! Without a tool (or with `CUDALLOC_NVTX=0`) every annotation is one predictable branch
//! on a process-wide state (`on`); with one, the calls go to the tool, off the hot path.
//! The pools' hit paths do not even pay that branch: they test `crate::observe`'s one
//! word for the trace recorder and this state together, whose NVTX bit stays set until
//! the first annotation finds no tool.

use core::ffi::{c_char, c_int, c_void};
use std::collections::{BTreeMap, HashMap};

use crate::sync::global::{lock, AtomicUsize, Mutex, OnceLock, Ordering};

// ---- The state, and the one branch ---------------------------------------------------

/// Not looked at yet: the first annotation loads the tool (or finds none).
const UNKNOWN: usize = 0;
/// No tool, or annotations switched off: every annotation is one branch.
const OFF: usize = 1;
/// A tool is attached.
const ON: usize = 2;

static STATE: AtomicUsize = AtomicUsize::new(UNKNOWN);
static TOOL: OnceLock<Option<Tool>> = OnceLock::new();
/// Injection functions given in-process ([`inject_static`]), which take precedence over
/// `NVTX_INJECTION64_PATH`: NVTX's static injection (`nvtxDetail/nvtxInit.h` 83-87,
/// `InitializeInjectionNvtx2_fnptr`), used by tests with a fake tool.
static STATIC_INJECTION: OnceLock<(Option<CoreInit>, ExtInit)> = OnceLock::new();

/// Whether annotations may be on: false once it is known that no tool is attached (or
/// they are off), true before the first look (the annotation then looks) and with a
/// tool. Callers write `if nvtx::on() { nvtx::region_register(..) }`: without a tool, one
/// load and one branch that always goes the same way.
///
/// Built with `RUSTFLAGS="--cfg cudalloc_no_nvtx"` it is `false` at compile time, so the
/// annotations are compiled out: only for measuring what the one branch costs (the A/B of
/// BENCHMARKS.md, issue 24); no tool is then ever told about a pool.
#[inline(always)]
pub(crate) fn on() -> bool {
    !cfg!(cudalloc_no_nvtx) && STATE.load(Ordering::Relaxed) != OFF
}

/// Whether a tool is attached to this process's annotations (loading it at the first
/// call, as the first annotation would). False without `NVTX_INJECTION64_PATH`, with
/// `CUDALLOC_NVTX=0`, or when the library there is not an NVTX tool with the memory API.
/// Under compute-sanitizer, ask after the first CUDA allocation: the sanitizer wants CUDA
/// initialized before the first NVTX call.
///
/// ```
/// // Outside compute-sanitizer (or another NVTX tool) no tool is attached.
/// if std::env::var_os("NVTX_INJECTION64_PATH").is_none() {
///     assert!(!cudalloc::cuda::nvtx::attached());
/// }
/// ```
pub fn attached() -> bool {
    tool().is_some()
}

#[inline]
fn tool() -> Option<&'static Tool> {
    if STATE.load(Ordering::Relaxed) == OFF {
        return None;
    }
    let t = TOOL.get_or_init(load).as_ref();
    if STATE.load(Ordering::Relaxed) == UNKNOWN {
        STATE.store(if t.is_some() { ON } else { OFF }, Ordering::Relaxed);
        if t.is_none() {
            // No tool: the hot paths' shared branch need not come here any more.
            crate::observe::lower(crate::observe::NVTX, on);
        }
    }
    t
}

/// Gives the injection functions of a tool linked into this process (NVTX's static
/// injection), to be used instead of `NVTX_INJECTION64_PATH` at the first annotation.
/// Returns false if annotations were already set up (or another injection was given).
/// For tests of the protocol with a fake tool; a program has no reason to call it.
#[doc(hidden)]
pub fn inject_static(core: Option<CoreInit>, ext: ExtInit) -> bool {
    STATIC_INJECTION.set((core, ext)).is_ok() && TOOL.get().is_none()
}

// ---- The ABI (nvToolsExtMem.h, nvtxDetail/nvtxTypes.h, nvtxDetail/nvtxExtTypes.h) -----
// Public but hidden: for tests that play the tool's side (`tests/all/nvtx.rs`).

/// `nvtxGetExportTable` (`nvtxDetail/nvtxImpl.h` 94-95).
#[doc(hidden)]
pub type GetExportTable = unsafe extern "C" fn(export_table_id: u32) -> *const c_void;
/// `InitializeInjectionNvtx2` (`NvtxInitializeInjectionNvtxFunc_t`): nonzero on success.
#[doc(hidden)]
pub type CoreInit = unsafe extern "C" fn(get_export_table: GetExportTable) -> c_int;
/// `InitializeInjectionNvtxExtension` (`nvtxDetail/nvtxExtTypes.h` 54): nonzero on success.
#[doc(hidden)]
pub type ExtInit = unsafe extern "C" fn(module: *mut ExtModuleInfo) -> c_int;

/// `nvtxExtModuleSegment_t` (`nvtxDetail/nvtxExtTypes.h` 35-40).
#[doc(hidden)]
#[repr(C)]
#[derive(Debug)]
pub struct ExtModuleSegment {
    /// `segmentId`: [`MEM_SEGMENT_ID`].
    pub segment_id: usize,
    /// `slotCount`: [`MEM_SLOT_COUNT`].
    pub slot_count: usize,
    /// `functionSlots`: slot `i` is the function of callback id `i`.
    pub function_slots: *mut isize,
}

/// `nvtxExtModuleInfo_t` (`nvtxDetail/nvtxExtTypes.h` 42-52).
#[doc(hidden)]
#[repr(C)]
#[derive(Debug)]
pub struct ExtModuleInfo {
    /// `nvtxVer`: 3.
    pub nvtx_ver: u16,
    /// `structSize`.
    pub struct_size: u16,
    /// `moduleId`: `NVTX_EXT_MODULEID_MEM` (1).
    pub module_id: u16,
    /// `compatId`: `NVTX_EXT_COMPATID_MEM` (0x0102).
    pub compat_id: u16,
    /// `segmentsCount`.
    pub segments_count: usize,
    /// `segments`.
    pub segments: *mut ExtModuleSegment,
    /// `getExportFunction` (none for this module).
    pub get_export_function: *const c_void,
    /// `extInfo` (none).
    pub ext_info: *const c_void,
}

/// `NVTX_VERSION` (`nvToolsExt.h` 167).
#[doc(hidden)]
pub const NVTX_VERSION: u16 = 3;
/// `NVTX_EXT_MODULEID_MEM` (`nvToolsExtMem.h` 30).
#[doc(hidden)]
pub const MODULE_ID_MEM: u16 = 1;
/// `NVTX_EXT_COMPATID_MEM` (`nvToolsExtMem.h` 36).
#[doc(hidden)]
pub const COMPAT_ID_MEM: u16 = 0x0102;
/// `NVTX3EXT_CBID_MEM_FN_NUM` (`nvToolsExtMem.h` 679): the memory API's functions.
#[doc(hidden)]
pub const MEM_FN_NUM: usize = 17;
/// The memory module's one segment id, hard-coded as 1 by NVTX 3.2's
/// `nvtxExtImplMem_v1.h` (`nvtxExtMemInitOnce`); the older headers sent 0 ("unused"),
/// which compute-sanitizer 2025.3.1 does not serve.
#[doc(hidden)]
pub const MEM_SEGMENT_ID: usize = 1;
/// `NVTX_EXT_MEM_SLOT_COUNT` (NVTX 3.2's `nvtxExtImplMem_v1.h`): the slots the module
/// offers, of which the tool fills the first [`MEM_FN_NUM`].
#[doc(hidden)]
pub const MEM_SLOT_COUNT: usize = 63;
/// `NVTX3EXT_CBID_nvtxMemHeapRegister` and the others used here, numbered from 0 as in
/// NVTX 3.2's `nvToolsExtMem.h` (CUDA 13.0: 694-699, `#define`s). The older headers
/// numbered them from 1 (enum `NvtxExtMemCallbackId`, "CBID 0 is invalid"); a tool of
/// CUDA 13 fills slots 0-16, so a caller counting from 1 calls the wrong functions
/// (compute-sanitizer 2025.3.1 then reports "nvtxMemHeapUnregister failed" at a heap
/// registration, and crashes at a region's).
#[doc(hidden)]
pub const CBID_HEAP_REGISTER: usize = 0;
/// `NVTX3EXT_CBID_nvtxMemHeapUnregister`.
#[doc(hidden)]
pub const CBID_HEAP_UNREGISTER: usize = 1;
/// `NVTX3EXT_CBID_nvtxMemRegionsRegister`.
#[doc(hidden)]
pub const CBID_REGIONS_REGISTER: usize = 3;
/// `NVTX3EXT_CBID_nvtxMemRegionsUnregister`.
#[doc(hidden)]
pub const CBID_REGIONS_UNREGISTER: usize = 5;

/// `NVTX_ETID_CALLBACKS` and `NVTX_ETID_VERSIONINFO` (`nvtxDetail/nvtxTypes.h` 269-271).
#[doc(hidden)]
pub const ETID_CALLBACKS: u32 = 1;
/// See [`ETID_CALLBACKS`].
#[doc(hidden)]
pub const ETID_VERSIONINFO: u32 = 3;
/// `NVTX_CB_MODULE_CORE2` (`nvtxDetail/nvtxTypes.h` 146).
#[doc(hidden)]
pub const CB_MODULE_CORE2: u32 = 5;
/// `NVTX_CBID_CORE2_DomainCreateA` (`nvtxDetail/nvtxTypes.h` 190).
#[doc(hidden)]
pub const CBID_CORE2_DOMAIN_CREATE_A: usize = 12;
/// `NVTX_CBID_CORE2_Initialize` (`nvtxDetail/nvtxTypes.h` 193).
#[doc(hidden)]
pub const CBID_CORE2_INITIALIZE: usize = 15;

/// `NvtxExportTableCallbacks` (`nvtxDetail/nvtxTypes.h` 280-289).
#[doc(hidden)]
#[repr(C)]
#[derive(Debug)]
pub struct ExportTableCallbacks {
    /// `struct_size`.
    pub struct_size: usize,
    /// `GetModuleFunctionTable(module, &table, &size)`: `table` is an array of `size + 1`
    /// pointers to function-pointer cells (the first and last null), which the tool writes.
    pub get_module_function_table:
        unsafe extern "C" fn(module: u32, out_table: *mut *mut *mut usize, out_size: *mut u32) -> c_int,
}

/// `NvtxExportTableVersionInfo` (`nvtxDetail/nvtxTypes.h` 291-309).
#[repr(C)]
#[derive(Debug)]
struct ExportTableVersionInfo {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: unsafe extern "C" fn(version: u32),
}

/// `nvtxMemVirtualRangeDesc_v1` (`nvToolsExtMem.h` 175).
#[doc(hidden)]
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct VirtualRangeDesc {
    /// `size`.
    pub size: usize,
    /// `ptr`.
    pub ptr: *const c_void,
}

/// `nvtxMemHeapDesc_v1` (`nvToolsExtMem.h` 184).
#[doc(hidden)]
#[repr(C)]
#[derive(Debug)]
pub struct HeapDesc {
    /// `extCompatID`: [`COMPAT_ID_MEM`].
    pub ext_compat_id: u16,
    /// `structSize`.
    pub struct_size: u16,
    /// `reserved0`.
    pub reserved0: u32,
    /// `usage`: `NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR` (1).
    pub usage: u32,
    /// `type`: `NVTX_MEM_TYPE_VIRTUAL_ADDRESS` (1).
    pub kind: u32,
    /// `typeSpecificDescSize`.
    pub type_specific_desc_size: usize,
    /// `typeSpecificDesc`: a [`VirtualRangeDesc`].
    pub type_specific_desc: *const c_void,
    /// `category`.
    pub category: u32,
    /// `messageType` (`NVTX_MESSAGE_TYPE_ASCII`, 1).
    pub message_type: u32,
    /// `message` (an ASCII string).
    pub message: *const c_char,
}

/// `nvtxMemRegionsRegisterBatch_v1` (`nvToolsExtMem.h` 316).
#[doc(hidden)]
#[repr(C)]
#[derive(Debug)]
pub struct RegionsRegisterBatch {
    /// `extCompatID`.
    pub ext_compat_id: u16,
    /// `structSize`.
    pub struct_size: u16,
    /// `regionType`: `NVTX_MEM_TYPE_VIRTUAL_ADDRESS`.
    pub region_type: u32,
    /// `heap`.
    pub heap: *mut c_void,
    /// `regionCount`.
    pub region_count: usize,
    /// `regionDescElementSize`.
    pub region_desc_element_size: usize,
    /// `regionDescElements`: [`VirtualRangeDesc`]s.
    pub region_desc_elements: *const c_void,
    /// `regionHandleElementsOut` (null: regions are named by their address).
    pub region_handle_elements_out: *mut *mut c_void,
}

/// `nvtxMemRegionsUnregisterBatch_v1` (`nvToolsExtMem.h` 401).
#[doc(hidden)]
#[repr(C)]
#[derive(Debug)]
pub struct RegionsUnregisterBatch {
    /// `extCompatID`.
    pub ext_compat_id: u16,
    /// `structSize`.
    pub struct_size: u16,
    /// `refType`: `NVTX_MEM_REGION_REF_TYPE_POINTER` (1).
    pub ref_type: u32,
    /// `refCount`.
    pub ref_count: usize,
    /// `refElementSize`.
    pub ref_element_size: usize,
    /// `refElements`: the regions' addresses (`nvtxMemRegionRef_t`, a pointer).
    pub ref_elements: *const *const c_void,
}

/// `nvtxMemHeapRegister(domain, desc)`.
#[doc(hidden)]
pub type HeapRegisterFn = unsafe extern "C" fn(domain: *mut c_void, desc: *const HeapDesc) -> *mut c_void;
/// `nvtxMemHeapUnregister(domain, heap)`.
#[doc(hidden)]
pub type HeapUnregisterFn = unsafe extern "C" fn(domain: *mut c_void, heap: *mut c_void);
/// `nvtxMemRegionsRegister(domain, desc)`.
#[doc(hidden)]
pub type RegionsRegisterFn = unsafe extern "C" fn(domain: *mut c_void, desc: *const RegionsRegisterBatch);
/// `nvtxMemRegionsUnregister(domain, desc)`.
#[doc(hidden)]
pub type RegionsUnregisterFn = unsafe extern "C" fn(domain: *mut c_void, desc: *const RegionsUnregisterBatch);
type DomainCreateAFn = unsafe extern "C" fn(name: *const c_char) -> *mut c_void;
type InitializeFn = unsafe extern "C" fn(reserved: *const c_void);

/// `nvToolsExtMem.h` 91, 121 and 380; `nvToolsExt.h` 301.
const HEAP_USAGE_SUB_ALLOCATOR: u32 = 1;
const MEM_TYPE_VIRTUAL_ADDRESS: u32 = 1;
const REGION_REF_TYPE_POINTER: u32 = 1;
const MESSAGE_TYPE_ASCII: u32 = 1;
/// `NVTX_MEM_HEAP_HANDLE_NO_TOOL` (`nvToolsExtMem.h` 42): what a heap registration returns
/// without a tool.
const HEAP_HANDLE_NO_TOOL: usize = usize::MAX;

// Field offsets as the C compiler lays the structs out on 64-bit targets.
const _: () = {
    assert!(size_of::<ExtModuleSegment>() == 24);
    assert!(size_of::<ExtModuleInfo>() == 40);
    assert!(size_of::<VirtualRangeDesc>() == 16);
    assert!(size_of::<HeapDesc>() == 48);
    assert!(size_of::<RegionsRegisterBatch>() == 48);
    assert!(size_of::<RegionsUnregisterBatch>() == 32);
    assert!(size_of::<ExportTableVersionInfo>() == 24);
};

// ---- Core's export table (what the tool reads in InitializeInjectionNvtx2) ----------

/// The core modules' callback counts, `NVTX_CBID_<MODULE>_SIZE` for modules 1..=6 (CORE,
/// CUDA, OPENCL, CUDART, CORE2, SYNC: `nvtxDetail/nvtxTypes.h` 141-261).
const CORE_MODULE_SIZES: [usize; 6] = [16, 9, 15, 7, 16, 7];

/// The cells the tool writes its core functions into, and the tables pointing at them
/// (`nvtxDetail/nvtxImpl.h` 180-185: a table is `[null, &cell_1, .., &cell_{size-1}, null]`).
/// Leaked: the tool may keep the pointers for the life of the process.
struct CoreTables {
    cells: Vec<&'static [AtomicUsize]>,
    tables: Vec<&'static mut [*mut usize]>,
}

// SAFETY: the raw pointers point into leaked cells, valid and shared for the process's
// life; the tables are written once, before the tool sees them.
unsafe impl Send for CoreTables {}
// SAFETY: as above.
unsafe impl Sync for CoreTables {}

static CORE_TABLES: OnceLock<Mutex<CoreTables>> = OnceLock::new();

fn core_tables() -> &'static Mutex<CoreTables> {
    CORE_TABLES.get_or_init(|| {
        let mut cells = Vec::new();
        let mut tables = Vec::new();
        for size in CORE_MODULE_SIZES {
            let c: &'static [AtomicUsize] = Box::leak((0..size).map(|_| AtomicUsize::new(0)).collect());
            let mut t = vec![core::ptr::null_mut::<usize>(); size + 1];
            for (i, cell) in c.iter().enumerate().skip(1) {
                t[i] = cell.as_ptr();
            }
            cells.push(c);
            tables.push(Box::leak(t.into_boxed_slice()));
        }
        Mutex::new(CoreTables { cells, tables })
    })
}

unsafe extern "C" fn get_module_function_table(
    module: u32,
    out_table: *mut *mut *mut usize,
    out_size: *mut u32,
) -> c_int {
    let Some(i) = (module as usize)
        .checked_sub(1)
        .filter(|&i| i < CORE_MODULE_SIZES.len())
    else {
        return 0;
    };
    let mut t = lock(core_tables());
    let table = t.tables[i].as_mut_ptr();
    if !out_size.is_null() {
        // SAFETY: the tool passes a writable u32 (or null, checked).
        unsafe { *out_size = CORE_MODULE_SIZES[i] as u32 };
    }
    if !out_table.is_null() {
        // SAFETY: the tool passes a writable table pointer (or null, checked).
        unsafe { *out_table = table };
    }
    1
}

unsafe extern "C" fn set_injection_nvtx_version(_version: u32) {}

static CALLBACKS: ExportTableCallbacks = ExportTableCallbacks {
    struct_size: size_of::<ExportTableCallbacks>(),
    get_module_function_table,
};

static VERSION_INFO: ExportTableVersionInfo = ExportTableVersionInfo {
    struct_size: size_of::<ExportTableVersionInfo>(),
    version: NVTX_VERSION as u32,
    reserved0: 0,
    set_injection_nvtx_version,
};

/// `nvtxGetExportTable` (`nvtxDetail/nvtxImpl.h` 417-425).
unsafe extern "C" fn get_export_table(id: u32) -> *const c_void {
    match id {
        ETID_CALLBACKS => (&raw const CALLBACKS).cast(),
        ETID_VERSIONINFO => (&raw const VERSION_INFO).cast(),
        _ => core::ptr::null(),
    }
}

/// The function the tool wrote for callback `cbid` of core module `module` (1-based), or 0.
fn core_function(module: usize, cbid: usize) -> usize {
    let t = lock(core_tables());
    t.cells[module - 1]
        .get(cbid)
        .map_or(0, |c| c.load(Ordering::Acquire))
}

// ---- Loading the tool -----------------------------------------------------------------

/// An attached tool: its memory functions, our domain, and what is registered (a heap's
/// handle by its base address, a live region's heap by its address), so that a region
/// goes to the heap holding it and nothing is unregistered twice.
struct Tool {
    domain: *mut c_void,
    heap_register: HeapRegisterFn,
    heap_unregister: HeapUnregisterFn,
    regions_register: RegionsRegisterFn,
    regions_unregister: RegionsUnregisterFn,
    registry: Mutex<Registry>,
    /// Kept open for the life of the process (NVTX never closes a tool it initialized).
    _library: Option<libloading::Library>,
}

// SAFETY: the domain is an opaque handle the tool made for use from any thread (NVTX's
// functions are thread-safe); the rest is function pointers and a mutex.
unsafe impl Send for Tool {}
// SAFETY: as above.
unsafe impl Sync for Tool {}

#[derive(Default)]
struct Registry {
    /// base -> (end, the tool's handle)
    heaps: BTreeMap<u64, (u64, usize)>,
    /// address of a live region -> base of its heap
    regions: HashMap<u64, u64>,
}

/// Why no tool is attached (the last reason the loader gave), for diagnostics.
static WHY_NOT: OnceLock<String> = OnceLock::new();

/// Records why no tool is attached, and logs it.
fn not_attached(why: String) {
    log::warn!("cudalloc: {why}");
    let _ = WHY_NOT.set(why);
}

/// Whether a tool is attached, or why not: `"attached"`, `"no tool"` (no
/// `NVTX_INJECTION64_PATH`), or the loader's reason (diagnostics: the sanitizer tests
/// print it).
///
/// ```
/// let s = cudalloc::cuda::nvtx::status();
/// assert!(!s.is_empty());
/// ```
pub fn status() -> String {
    if attached() {
        return "attached".into();
    }
    WHY_NOT.get().cloned().unwrap_or_else(|| "no tool".into())
}

fn load() -> Option<Tool> {
    let enabled = crate::util::env_var(
        "CUDALLOC_NVTX",
        "1, true, yes or on (or 0, false, no, off)",
        crate::util::parse_bool,
    );
    if enabled == Some(false) {
        log::info!("cudalloc: CUDALLOC_NVTX=0: no NVTX memory annotations");
        return None;
    }
    if let Some(&(core, ext)) = STATIC_INJECTION.get() {
        return attach(core, ext, None);
    }
    let path = std::env::var_os("NVTX_INJECTION64_PATH").filter(|p| !p.is_empty())?;
    // SAFETY: loading the library runs its initializers; NVTX_INJECTION64_PATH names an
    // NVTX tool by the protocol's contract, loaded the way NVTX loads it (dlopen, lazy).
    let library = match unsafe { libloading::Library::new(&path) } {
        Ok(l) => l,
        Err(e) => {
            not_attached(format!(
                "NVTX_INJECTION64_PATH={}: {e}; no NVTX annotations",
                std::path::Path::new(&path).display()
            ));
            return None;
        }
    };
    // SAFETY: the symbols' types are the protocol's (nvtxInit.h 111, nvtxExtInit.h 124).
    let core = unsafe { library.get::<CoreInit>(b"InitializeInjectionNvtx2\0") }
        .ok()
        .map(|s| *s);
    // SAFETY: as above.
    let ext = match unsafe { library.get::<ExtInit>(b"InitializeInjectionNvtxExtension\0") } {
        Ok(s) => *s,
        Err(_) => {
            not_attached(format!(
                "{} has no InitializeInjectionNvtxExtension (no NVTX memory API); no annotations",
                std::path::Path::new(&path).display()
            ));
            return None;
        }
    };
    attach(core, ext, Some(library))
}

/// The handshake: core first (as `nvtxExtInitOnce` calls `nvtxInitialize(0)` first,
/// `nvtxDetail/nvtxExtInit.h` 329), then the memory module.
fn attach(core: Option<CoreInit>, ext: ExtInit, library: Option<libloading::Library>) -> Option<Tool> {
    let mut domain = core::ptr::null_mut();
    if let Some(init) = core {
        // SAFETY: the tool's entry point with the protocol's argument; our export tables
        // live for the process.
        if unsafe { init(get_export_table) } != 0 {
            let initialize = core_function(5, CBID_CORE2_INITIALIZE);
            if initialize != 0 {
                // SAFETY: the cell holds the tool's nvtxInitialize, of this type.
                let f: InitializeFn = unsafe { core::mem::transmute::<usize, InitializeFn>(initialize) };
                // SAFETY: nvtxInitialize(NULL), as nvtxInitialize(0) calls it.
                unsafe { f(core::ptr::null()) };
            }
            let create = core_function(5, CBID_CORE2_DOMAIN_CREATE_A);
            if create != 0 {
                // SAFETY: the cell holds the tool's nvtxDomainCreateA, of this type.
                let f: DomainCreateAFn = unsafe { core::mem::transmute::<usize, DomainCreateAFn>(create) };
                // SAFETY: a NUL-terminated static name.
                domain = unsafe { f(c"cudalloc".as_ptr()) };
            }
        } else {
            not_attached("the NVTX tool refused InitializeInjectionNvtx2".into());
        }
    }
    // MEM_SLOT_COUNT slots, slot `i` for callback id `i` (as `nvtxExtMemSlots + 1` in
    // nvtxExtImplMem_v1.h), leaked: the tool may keep the module's pointers.
    let slots: &'static mut [isize] = Box::leak(vec![0isize; MEM_SLOT_COUNT].into_boxed_slice());
    let segment: &'static mut ExtModuleSegment = Box::leak(Box::new(ExtModuleSegment {
        segment_id: MEM_SEGMENT_ID,
        slot_count: MEM_SLOT_COUNT,
        function_slots: slots.as_mut_ptr(),
    }));
    let module: &'static mut ExtModuleInfo = Box::leak(Box::new(ExtModuleInfo {
        nvtx_ver: NVTX_VERSION,
        struct_size: size_of::<ExtModuleInfo>() as u16,
        module_id: MODULE_ID_MEM,
        compat_id: COMPAT_ID_MEM,
        segments_count: 1,
        segments: segment,
        get_export_function: core::ptr::null(),
        ext_info: core::ptr::null(),
    }));
    // SAFETY: the tool's entry point with a module described as nvtxExtImplMem_v1.h does.
    if unsafe { ext(module) } == 0 {
        not_attached("the NVTX tool refused the memory module".into());
        return None;
    }
    // SAFETY: the tool wrote its functions (or left 0) through `function_slots`; read
    // them back through the same pointer.
    let slot = |i: usize| unsafe { *segment.function_slots.add(i) } as usize;
    let (hr, hu, rr, ru) = (
        slot(CBID_HEAP_REGISTER),
        slot(CBID_HEAP_UNREGISTER),
        slot(CBID_REGIONS_REGISTER),
        slot(CBID_REGIONS_UNREGISTER),
    );
    // 0 is NVTX_EXTENSION_FRESH (not written), 1 NVTX_EXTENSION_DISABLED
    // (nvtxDetail/nvtxExtImpl.h 83-84): neither is a function.
    if [hr, hu, rr, ru].iter().any(|&f| f <= 1) {
        not_attached(format!(
            "the NVTX tool does not take heaps and regions (slots {hr:#x} {hu:#x} {rr:#x} {ru:#x}, \
             domain {domain:?}); no annotations"
        ));
        return None;
    }
    log::info!("cudalloc: NVTX tool attached: pools annotate their heaps and regions");
    // SAFETY: the slots hold the tool's implementations of these functions.
    unsafe {
        Some(Tool {
            domain,
            heap_register: core::mem::transmute::<usize, HeapRegisterFn>(hr),
            heap_unregister: core::mem::transmute::<usize, HeapUnregisterFn>(hu),
            regions_register: core::mem::transmute::<usize, RegionsRegisterFn>(rr),
            regions_unregister: core::mem::transmute::<usize, RegionsUnregisterFn>(ru),
            registry: Mutex::new(Registry::default()),
            _library: library,
        })
    }
}

// ---- The annotations ------------------------------------------------------------------

/// Memory `ptr..ptr + bytes` that a pool took from the driver: a heap, none of it live.
#[cold]
#[inline(never)]
pub(crate) fn heap_register(ptr: u64, bytes: usize) {
    let Some(t) = tool() else { return };
    if ptr == 0 || bytes == 0 {
        return;
    }
    let range = VirtualRangeDesc {
        size: bytes,
        ptr: ptr as usize as *const c_void,
    };
    let desc = HeapDesc {
        ext_compat_id: COMPAT_ID_MEM,
        struct_size: size_of::<HeapDesc>() as u16,
        reserved0: 0,
        usage: HEAP_USAGE_SUB_ALLOCATOR,
        kind: MEM_TYPE_VIRTUAL_ADDRESS,
        type_specific_desc_size: size_of::<VirtualRangeDesc>(),
        type_specific_desc: (&raw const range).cast(),
        category: 0,
        message_type: MESSAGE_TYPE_ASCII,
        message: c"cudalloc pool block".as_ptr(),
    };
    let mut r = lock(&t.registry);
    if r.heaps.contains_key(&ptr) {
        return;
    }
    // SAFETY: the tool's nvtxMemHeapRegister with a valid descriptor; called under the
    // registry's lock so that the registry and the tool agree.
    let handle = unsafe { (t.heap_register)(t.domain, &desc) } as usize;
    // A heap of virtual addresses is named by its base address (nvToolsExtMem.h, on
    // nvtxMemHeapRegister): any other answer is a refusal (compute-sanitizer 2025.3.1
    // returns null or garbage for memory it does not take as a heap, and crashes on
    // regions registered in it), so the heap's blocks stay unannotated.
    if handle as u64 == ptr {
        r.heaps.insert(ptr, (ptr + bytes as u64, handle));
    } else if handle != HEAP_HANDLE_NO_TOOL {
        refused_heap(ptr, bytes, handle);
    }
}

/// Logs (once) that the tool refused a heap.
#[cold]
fn refused_heap(ptr: u64, bytes: usize, handle: usize) {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        log::warn!(
            "cudalloc: the NVTX tool refused the heap {ptr:#x}+{bytes} (handle {handle:#x}): \
             its blocks are not annotated"
        );
    });
}

/// The heap at `ptr` goes back to the driver: unregistered, with any region still in it.
#[cold]
#[inline(never)]
pub(crate) fn heap_unregister(ptr: u64) {
    let Some(t) = tool() else { return };
    let mut r = lock(&t.registry);
    let Some((end, handle)) = r.heaps.remove(&ptr) else {
        return;
    };
    r.regions
        .retain(|&a, &mut base| !(base == ptr || (ptr..end).contains(&a)));
    // SAFETY: a handle the tool returned and that was not unregistered yet.
    unsafe { (t.heap_unregister)(t.domain, handle as *mut c_void) };
}

/// `ptr..ptr + bytes`, in a registered heap, is handed out: a live region. Nothing for
/// memory in no heap (a pool with annotations off, the simulator).
#[cold]
#[inline(never)]
pub(crate) fn region_register(ptr: u64, bytes: usize) {
    let Some(t) = tool() else { return };
    if ptr == 0 || bytes == 0 {
        return;
    }
    let mut r = lock(&t.registry);
    let Some((&base, &(end, handle))) = r.heaps.range(..=ptr).next_back() else {
        return;
    };
    if ptr + bytes as u64 > end || r.regions.contains_key(&ptr) {
        return;
    }
    let range = VirtualRangeDesc {
        size: bytes,
        ptr: ptr as usize as *const c_void,
    };
    let batch = RegionsRegisterBatch {
        ext_compat_id: COMPAT_ID_MEM,
        struct_size: size_of::<RegionsRegisterBatch>() as u16,
        region_type: MEM_TYPE_VIRTUAL_ADDRESS,
        heap: handle as *mut c_void,
        region_count: 1,
        region_desc_element_size: size_of::<VirtualRangeDesc>(),
        region_desc_elements: (&raw const range).cast(),
        region_handle_elements_out: core::ptr::null_mut(),
    };
    // SAFETY: the tool's nvtxMemRegionsRegister with a valid batch of one region inside
    // the registered heap `handle`.
    unsafe { (t.regions_register)(t.domain, &batch) };
    r.regions.insert(ptr, base);
}

/// The region at `ptr` is no longer live (freed, cached, reset). Nothing if it is not
/// a registered region.
#[cold]
#[inline(never)]
pub(crate) fn region_unregister(ptr: u64) {
    let Some(t) = tool() else { return };
    let mut r = lock(&t.registry);
    if r.regions.remove(&ptr).is_none() {
        return;
    }
    let addr = ptr as usize as *const c_void;
    let batch = RegionsUnregisterBatch {
        ext_compat_id: COMPAT_ID_MEM,
        struct_size: size_of::<RegionsUnregisterBatch>() as u16,
        ref_type: REGION_REF_TYPE_POINTER,
        ref_count: 1,
        ref_element_size: size_of::<*const c_void>(),
        ref_elements: &addr,
    };
    // SAFETY: the tool's nvtxMemRegionsUnregister with a batch naming one live region.
    unsafe { (t.regions_unregister)(t.domain, &batch) };
}

// ---- Host memory: the pinned and managed pools and arenas --------------------------------

/// A block a host pool or arena took from `source` (`ptr..ptr + bytes`): a heap if the
/// GPU reaches it at its host address ([`MemorySource::device_mapped`]: pinned and
/// managed memory, not the pageable fallback). Returns whether it is a heap now (false
/// without a tool, for memory no kernel reaches, and when the tool refuses the heap).
///
/// [`MemorySource::device_mapped`]: crate::source::MemorySource::device_mapped
#[cold]
#[inline(never)]
pub(crate) fn host_heap_register<S: crate::source::MemorySource + ?Sized>(
    source: &S,
    ptr: core::ptr::NonNull<u8>,
    bytes: usize,
) -> bool {
    if tool().is_none() || !source.device_mapped(ptr, bytes) {
        return false;
    }
    let base = ptr.as_ptr() as u64;
    heap_register(base, bytes);
    heap_holding(base).is_some_and(|(b, _)| b == base)
}

/// The registered heap holding `ptr`, as `(base, bytes)`: `None` without a tool, or if no
/// heap holds it (memory that is not annotated, or a heap the tool refused). For tests and
/// diagnostics (the sanitizer tests print it).
///
/// ```
/// if !cudalloc::cuda::nvtx::attached() {
///     assert_eq!(cudalloc::cuda::nvtx::heap_holding(0x1000), None);
/// }
/// ```
#[doc(hidden)]
pub fn heap_holding(ptr: u64) -> Option<(u64, usize)> {
    let t = tool()?;
    let r = lock(&t.registry);
    let (&base, &(end, _)) = r.heaps.range(..=ptr).next_back()?;
    (ptr < end).then_some((base, (end - base) as usize))
}
