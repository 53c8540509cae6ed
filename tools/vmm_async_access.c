// Can the page heap's growth grant access off the allocating thread? (issue 23, the forward
// pass: cuMemSetAccess is most of a growth's cost.) Measures, on the GPU machine:
//   A. N growths of 16 MiB on one thread: create + map + access, per growth.
//   B. The same with the access call handed to a worker thread, the stream gated on a
//      host-written flag (cuStreamWaitValue32): the allocating thread's cost per growth,
//      and the time until the worker is done.
//   C. Whether the driver serializes: create + map alone, with and without the worker
//      granting access at the same time.
//   D. Whether work can be queued behind the gate: a memset of each new chunk queued
//      right after its gate (the driver checks the range at enqueue).
// Result (H100, 2026-12-06): the memset is refused (invalid argument) while the grant is
// pending, so a growth cannot hand its block out before its access call: not pursued.
//   nvcc -O2 -o /tmp/vmm_async_access tools/vmm_async_access.c -lcuda -lpthread && /tmp/vmm_async_access
#include <cuda.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define CK(x) do { CUresult r = (x); if (r) { const char* s; cuGetErrorString(r, &s); printf("%s:%d %s -> %s\n", __FILE__, __LINE__, #x, s); exit(1);} } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
enum { N = 300, SZ = 16 << 20 };
static CUmemAllocationProp prop; static CUmemAccessDesc acc; static CUcontext ctx;
static CUdeviceptr base; static size_t off;
static volatile unsigned* flag; static CUdeviceptr flag_dev;
static _Atomic long queued, granted; static CUdeviceptr todo[N + 1];
static _Atomic int stop;
static void* worker(void* a) {
  (void)a; CK(cuCtxSetCurrent(ctx));
  long done = 0;
  while (!atomic_load(&stop) || done < atomic_load(&queued)) {
    if (done < atomic_load(&queued)) {
      CK(cuMemSetAccess(todo[done], SZ, &acc, 1));
      done++; atomic_store(&granted, done);
      *flag = (unsigned)done; __sync_synchronize();
    }
  }
  return 0;
}
static int cmp(const void* a, const void* b) { double x = *(double*)a, y = *(double*)b; return x < y ? -1 : x > y; }
static void stats(const char* what, double* v, int n) {
  double s = 0; for (int i = 0; i < n; i++) s += v[i];
  qsort(v, n, 8, cmp);
  printf("%-58s median %6.1f us, p90 %6.1f, mean %6.1f, total %7.2f ms\n", what, v[n / 2], v[n * 9 / 10], s / n, s / 1e3);
}
static CUdeviceptr grow(int with_access, double* t_out) {
  double t = now(); CUmemGenericAllocationHandle h;
  CK(cuMemCreate(&h, SZ, &prop, 0)); CK(cuMemMap(base + off, SZ, 0, h, 0));
  if (with_access) CK(cuMemSetAccess(base + off, SZ, &acc, 1));
  *t_out = now() - t; CUdeviceptr p = base + off; off += SZ; return p;
}
int main(void) {
  CK(cuInit(0)); CUdevice d; CK(cuDeviceGet(&d, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, d)); CK(cuCtxSetCurrent(ctx));
  int memops = 0; CK(cuDeviceGetAttribute(&memops, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, d));
  printf("stream memory operations: %d\n", memops);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemAddressReserve(&base, (size_t)1 << 38, 0, 0, 0));
  void* fh; CK(cuMemHostAlloc(&fh, 64, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE)); flag = fh; *flag = 0;
  CK(cuMemHostGetDevicePointer(&flag_dev, fh, 0));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  static double v[N], w[N];
  // warm-up
  for (int i = 0; i < 10; i++) grow(1, &v[i]);
  // A
  for (int i = 0; i < N; i++) grow(1, &v[i]);
  stats("A: create+map+access on the allocating thread", v, N);
  // C (alone): create+map without access (mappings left without access, never used)
  for (int i = 0; i < N; i++) grow(0, &v[i]);
  stats("C: create+map alone", v, N);
  // B: access on a worker, stream gated
  pthread_t th; atomic_store(&stop, 0); atomic_store(&queued, 0); atomic_store(&granted, 0);
  pthread_create(&th, 0, worker, 0);
  double t0 = now(); double gate_enq[N]; int refused = 0;
  for (int i = 0; i < N; i++) {
    double t = now();
    CUdeviceptr p = grow(0, &w[i]);
    todo[i] = p; atomic_store(&queued, i + 1);
    double g = now();
    CK(cuStreamWaitValue32(s, flag_dev, (unsigned)(i + 1), CU_STREAM_WAIT_VALUE_GEQ));
    gate_enq[i] = now() - g;
    // Queued before the worker may have granted access: the driver checks the range at
    // enqueue, so this fails while the grant is pending (counted, not fatal).
    if (cuMemsetD8Async(p, (unsigned char)i, SZ, s) != CUDA_SUCCESS) refused++;
    v[i] = now() - t;
  }
  double t_loop = now() - t0;
  atomic_store(&stop, 1); pthread_join(th, 0);
  double t_grants = now() - t0;
  CK(cuStreamSynchronize(s));
  double t_all = now() - t0;
  stats("B: allocating thread per growth (create+map+gate+memset)", v, N);
  stats("B: of which create+map (worker granting meanwhile)", w, N);
  stats("B: of which cuStreamWaitValue32 enqueue", gate_enq, N);
  printf("B: memsets refused at enqueue (access not yet granted): %d of %d\n", refused, N);
  printf("B: loop %.2f ms, worker done at %.2f ms, stream done at %.2f ms\n", t_loop / 1e3, t_grants / 1e3, t_all / 1e3);
  // D: the chunks whose memset was accepted hold its bytes
  unsigned char* h = malloc(4096); int bad = 0;
  for (int i = 0; i < N; i++) { CK(cuMemcpyDtoH(h, todo[i] + SZ - 4096, 4096)); for (int j = 0; j < 4096; j++) if (h[j] != (unsigned char)i) { bad++; break; } }
  printf("D: %d of %d chunks without their memset's bytes (refused ones included)\n", bad, N);
  // A again, interleaved after B (drift check)
  for (int i = 0; i < N; i++) grow(1, &v[i]);
  stats("A again: create+map+access on the allocating thread", v, N);
  return 0;
}
