// The costs of the VMM calls the page heap makes (issue 23, the forward pass): cuMemCreate,
// cuMemMap and cuMemSetAccess by size; one access call over k mappings; access re-set; 600
// growths of 16 MiB; an access call while the GPU copies; cuMemAllocAsync growth by 2.5 MiB.
// On the GPU machine (no Rust needed):
//   nvcc -O2 -o /tmp/vmm_costs tools/vmm_costs.c -lcuda && /tmp/vmm_costs
// Results: BENCHMARKS.md, "2026-12-05, third session".
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define CK(x) do { CUresult r = (x); if (r) { const char* s; cuGetErrorString(r, &s); printf("%s:%d %s -> %s\n", __FILE__, __LINE__, #x, s); exit(1);} } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static CUmemAllocationProp prop; static CUmemAccessDesc acc; static size_t gran;
static CUdeviceptr base; static size_t off = 0;
static CUmemGenericAllocationHandle mk(size_t sz, double* tc) { CUmemGenericAllocationHandle h; double t = now(); CK(cuMemCreate(&h, sz, &prop, 0)); *tc += now() - t; return h; }
static int cmp(const void* a, const void* b) { double x = *(double*)a, y = *(double*)b; return x < y ? -1 : x > y; }
int main(void) {
  CK(cuInit(0)); CUdevice d; CK(cuDeviceGet(&d, 0)); CUcontext c; CK(cuDevicePrimaryCtxRetain(&c, d)); CK(cuCtxSetCurrent(c));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  printf("granule %zu\n", gran);
  CK(cuMemAddressReserve(&base, (size_t)1 << 37, 0, 0, 0));
  size_t sizes[] = {2 << 20, 16 << 20, 64 << 20, 256 << 20};
  for (int si = 0; si < 4; si++) {
    size_t sz = sizes[si]; double tc = 0, tm[20], ta[20];
    for (int i = 0; i < 20; i++) {
      CUmemGenericAllocationHandle h = mk(sz, &tc);
      double t = now(); CK(cuMemMap(base + off, sz, 0, h, 0)); tm[i] = now() - t;
      t = now(); CK(cuMemSetAccess(base + off, sz, &acc, 1)); ta[i] = now() - t;
      off += sz;
    }
    qsort(tm, 20, 8, cmp); qsort(ta, 20, 8, cmp);
    printf("single %4zu MiB: create %.1f us avg, map median %.1f us, access median %.1f us (min %.1f max %.1f)\n", sz >> 20, tc / 20, tm[10], ta[10], ta[0], ta[19]);
  }
  // one access call over k adjacent 16 MiB mappings
  int ks[] = {1, 2, 4, 8, 16};
  for (int ki = 0; ki < 5; ki++) {
    int k = ks[ki]; double tc = 0, ta[10];
    for (int r = 0; r < 10; r++) {
      size_t start = off;
      for (int i = 0; i < k; i++) { CUmemGenericAllocationHandle h = mk(16 << 20, &tc); CK(cuMemMap(base + off, 16 << 20, 0, h, 0)); off += 16 << 20; }
      double t = now(); CK(cuMemSetAccess(base + start, (size_t)k * (16 << 20), &acc, 1)); ta[r] = now() - t;
    }
    qsort(ta, 10, 8, cmp);
    printf("one access over %2d x 16 MiB mappings: median %.1f us (%.1f us per mapping)\n", k, ta[5], ta[5] / k);
  }
  // re-setting access on an already accessible mapping
  { double ta[10]; for (int r = 0; r < 10; r++) { double t = now(); CK(cuMemSetAccess(base, 16 << 20, &acc, 1)); ta[r] = now() - t; } qsort(ta, 10, 8, cmp); printf("access set again on a range that has it (16 MiB): median %.1f us\n", ta[5]); }
  // growth of 600 x 16 MiB: does access cost grow with the mappings already there?
  { double tc = 0; double first = 0, last = 0; int n = 600; double tot = 0;
    for (int i = 0; i < n; i++) { CUmemGenericAllocationHandle h = mk(16 << 20, &tc); CK(cuMemMap(base + off, 16 << 20, 0, h, 0)); double t = now(); CK(cuMemSetAccess(base + off, 16 << 20, &acc, 1)); double e = now() - t; tot += e; if (i < 50) first += e; if (i >= n - 50) last += e; off += 16 << 20; }
    printf("growth 600 x 16 MiB: access avg %.1f us, first 50 avg %.1f, last 50 avg %.1f; create avg %.1f us\n", tot / n, first / 50, last / 50, tc / n);
  }
  // access with a busy stream? time access while a memset runs
  { CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); double tc = 0;
    CUmemGenericAllocationHandle h = mk(16 << 20, &tc); CK(cuMemMap(base + off, 16 << 20, 0, h, 0));
    CK(cuMemsetD8Async(base, 0, (size_t)9 << 30, s));
    double t = now(); CK(cuMemSetAccess(base + off, 16 << 20, &acc, 1)); double e = now() - t; off += 16 << 20;
    printf("access while a 9 GiB memset runs: %.1f us\n", e); CK(cuStreamSynchronize(s)); }
  // cuMemAllocAsync growth: 1000 x 2.5 MiB
  { CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CUdeviceptr p; CK(cuMemAllocAsync(&p, 1 << 20, s)); CK(cuMemFreeAsync(p, s)); CK(cuStreamSynchronize(s));
    CUmemoryPool pool; CK(cuDeviceGetDefaultMemPool(&pool, d)); cuuint64_t thr = ~0ull; CK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &thr));
    double t = now(); for (int i = 0; i < 1000; i++) CK(cuMemAllocAsync(&p, 2621440, s)); double e = now() - t;
    cuuint64_t res; CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res));
    printf("cuMemAllocAsync 1000 x 2.5 MiB: %.1f us total (%.2f us each), reserved %llu MiB for 2500 MiB\n", e, e / 1000, (unsigned long long)(res >> 20));
  }
  return 0;
}
