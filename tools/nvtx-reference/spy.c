/* spy.c: an NVTX injection library that sits between a program and the real tool
 * (SPY_REAL, e.g. compute-sanitizer's libsanitizer-collection.so) and logs the handshake to
 * stderr: which export tables the tool asks for, which core function cells it fills, the
 * memory module it is given and the slots it fills. Used to compare NVIDIA's headers
 * (probe.cu) with cudalloc's Rust handshake (src/cuda/nvtx.rs) under the same tool.
 *   gcc -shared -fPIC -O1 -o spy.so spy.c -ldl
 *   compute-sanitizer ... bash -c 'SPY_REAL=$NVTX_INJECTION64_PATH \
 *       NVTX_INJECTION64_PATH=/path/spy.so exec ./program'
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

typedef void (*Fn)(void);
typedef Fn** Table;
typedef const void* (*GetExportTable_t)(uint32_t);
typedef struct { size_t struct_size; int (*GetModuleFunctionTable)(int, Table*, unsigned*); } Callbacks;
typedef struct { size_t struct_size; uint32_t version; uint32_t reserved0; void (*SetVersion)(uint32_t); } VersionInfo;
typedef struct { size_t segmentId, slotCount; intptr_t* functionSlots; } Seg;
typedef struct {
  uint16_t nvtxVer, structSize, moduleId, compatId;
  size_t segmentsCount; Seg* segments; void* getExportFunction; const void* extInfo;
} ModInfo;

static void* real;
static GetExportTable_t app_get;
static const Callbacks* app_cb;
static Callbacks spy_cb;
static Table tables[8];
static unsigned sizes[8];
static Seg* last_seg;

static void* open_real(void) {
  if (!real) {
    const char* p = getenv("SPY_REAL");
    real = p ? dlopen(p, RTLD_NOW | RTLD_GLOBAL) : 0;
    fprintf(stderr, "spy: dlopen(%s) -> %p %s\n", p ? p : "(no SPY_REAL)", real, real ? "" : dlerror());
  }
  return real;
}

static int spy_gmft(int module, Table* out_table, unsigned* out_size) {
  int r = app_cb->GetModuleFunctionTable(module, out_table, out_size);
  fprintf(stderr, "spy: GetModuleFunctionTable(%d) -> %d size %u table %p\n", module, r,
          out_size ? *out_size : 0, out_table ? (void*)*out_table : 0);
  if (r && module > 0 && module < 8 && out_table && out_size) { tables[module] = *out_table; sizes[module] = *out_size; }
  return r;
}

static const void* spy_get(uint32_t id) {
  const void* t = app_get(id);
  fprintf(stderr, "spy: GetExportTable(%u) -> %p\n", id, t);
  if (id == 1 && t) {
    app_cb = t; spy_cb = *app_cb; spy_cb.GetModuleFunctionTable = spy_gmft;
    fprintf(stderr, "spy:   callbacks struct_size %zu\n", app_cb->struct_size);
    return &spy_cb;
  }
  if (id == 3 && t) {
    const VersionInfo* v = t;
    fprintf(stderr, "spy:   versioninfo struct_size %zu version %u\n", v->struct_size, v->version);
  }
  return t;
}

static void dump_core(const char* when) {
  for (int m = 1; m < 8; m++) {
    if (!tables[m]) continue;
    fprintf(stderr, "spy: %s core module %d:", when, m);
    for (unsigned i = 1; i < sizes[m]; i++)
      if (tables[m][i] && *tables[m][i]) fprintf(stderr, " %u", i);
    fprintf(stderr, "\n");
  }
}

static void dump_slots(const char* when) {
  if (!last_seg) return;
  fprintf(stderr, "spy: %s mem slots:", when);
  for (size_t i = 0; i < last_seg->slotCount; i++) fprintf(stderr, " %zu=%#lx", i, (long)last_seg->functionSlots[i]);
  fprintf(stderr, "\n");
}

/* The memory API's calls, logged then passed on (callback ids 1, 2, 4, 6). */
typedef struct { size_t size; const void* ptr; } Range;
typedef struct { uint16_t compat, size; uint32_t reserved0, usage, type; size_t tsize; const Range* range;
                 uint32_t category, message_type; const char* message; } HeapDesc;
typedef struct { uint16_t compat, size; uint32_t type; void* heap; size_t count, elem; const Range* regions; void** out; } RegBatch;
typedef struct { uint16_t compat, size; uint32_t ref_type; size_t count, elem; const void* const* refs; } UnregBatch;
static void* (*real_heap_register)(void*, const HeapDesc*);
static void (*real_heap_unregister)(void*, void*);
static void (*real_regions_register)(void*, const RegBatch*);
static void (*real_regions_unregister)(void*, const UnregBatch*);
static void* spy_heap_register(void* d, const HeapDesc* h) {
  fprintf(stderr, "spy: HeapRegister(domain %p, compat %#x size %u usage %u type %u tsize %zu range %p+%zu msgtype %u)",
          d, h->compat, h->size, h->usage, h->type, h->tsize, h->range ? h->range->ptr : 0, h->range ? h->range->size : 0, h->message_type);
  void* r = real_heap_register(d, h);
  fprintf(stderr, " -> %p\n", r);
  return r;
}
static void spy_heap_unregister(void* d, void* h) {
  fprintf(stderr, "spy: HeapUnregister(domain %p, heap %p)\n", d, h);
  real_heap_unregister(d, h);
}
static void spy_regions_register(void* d, const RegBatch* b) {
  fprintf(stderr, "spy: RegionsRegister(domain %p, compat %#x size %u type %u heap %p count %zu elem %zu first %p+%zu out %p)\n",
          d, b->compat, b->size, b->type, b->heap, b->count, b->elem, b->count ? b->regions[0].ptr : 0,
          b->count ? b->regions[0].size : 0, (void*)b->out);
  real_regions_register(d, b);
}
static void spy_regions_unregister(void* d, const UnregBatch* b) {
  fprintf(stderr, "spy: RegionsUnregister(domain %p, compat %#x size %u reftype %u count %zu elem %zu first %p)\n",
          d, b->compat, b->size, b->ref_type, b->count, b->elem, b->count ? b->refs[0] : 0);
  real_regions_unregister(d, b);
}
static void wrap_slots(intptr_t* s) {
  real_heap_register = (void*)s[1]; s[1] = (intptr_t)spy_heap_register;
  real_heap_unregister = (void*)s[2]; s[2] = (intptr_t)spy_heap_unregister;
  real_regions_register = (void*)s[4]; s[4] = (intptr_t)spy_regions_register;
  real_regions_unregister = (void*)s[6]; s[6] = (intptr_t)spy_regions_unregister;
}
static void on_signal(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  fprintf(stderr, "spy: signal %d, backtrace:\n", sig);
  backtrace_symbols_fd(frames, n, 2);
  _exit(128 + sig);
}

static void at_exit(void) { dump_core("at exit"); dump_slots("at exit"); }

int InitializeInjectionNvtx2(GetExportTable_t g) {
  app_get = g;
  int (*f)(GetExportTable_t) = open_real() ? (int (*)(GetExportTable_t))dlsym(real, "InitializeInjectionNvtx2") : 0;
  fprintf(stderr, "spy: InitializeInjectionNvtx2 (real %p)\n", (void*)f);
  int r = f ? f(spy_get) : 0;
  fprintf(stderr, "spy: real InitializeInjectionNvtx2 -> %d\n", r);
  dump_core("after core init");
  atexit(at_exit);
  return r;
}

int InitializeInjectionNvtxExtension(ModInfo* m) {
  fprintf(stderr, "spy: InitializeInjectionNvtxExtension ver %u size %u module %u compat %#x segments %zu getExport %p extInfo %p\n",
          m->nvtxVer, m->structSize, m->moduleId, m->compatId, m->segmentsCount, m->getExportFunction, m->extInfo);
  for (size_t s = 0; s < m->segmentsCount; s++)
    fprintf(stderr, "spy:   segment %zu id %zu slots %zu at %p\n", s, m->segments[s].segmentId, m->segments[s].slotCount,
            (void*)m->segments[s].functionSlots);
  if (m->segmentsCount) last_seg = &m->segments[0];
  dump_slots("before ext init");
  int (*f)(ModInfo*) = open_real() ? (int (*)(ModInfo*))dlsym(real, "InitializeInjectionNvtxExtension") : 0;
  int r = f ? f(m) : 0;
  fprintf(stderr, "spy: real InitializeInjectionNvtxExtension -> %d\n", r);
  dump_slots("after ext init");
  dump_core("after ext init");
  if (r && m->segmentsCount && m->segments[0].slotCount > 6 && m->segments[0].functionSlots[1] > 1 &&
      getenv("SPY_CALLS")) {
    wrap_slots(m->segments[0].functionSlots);
    signal(SIGSEGV, on_signal);
    signal(SIGABRT, on_signal);
    signal(SIGBUS, on_signal);
  }
  /* the module struct of NVIDIA's headers lives on the stack: keep a copy of the slots' address */
  if (m->segmentsCount) { static Seg copy; copy = m->segments[0]; last_seg = &copy; }
  return r;
}
