// probe_drv.cpp: as probe.cu, but through the driver API only (cuInit, the primary context,
// cuMemAlloc, cuModuleLoadData of kernel.ptx, cuLaunchKernel), as cudalloc does: the CUDA
// runtime is never initialized. Built with `nvcc -x c++ --cudart none -lcuda`.
// KIND (argv[2]) is where the heap's memory comes from, as cudalloc's backings take it:
//   alloc       cuMemAlloc (2 MiB)
//   alloc4k     cuMemAlloc of 4 KiB, written 96 bytes past the region (inside the heap)
//   async       cuMemAllocAsync on a stream, registered at once (the allocation may not
//               have run on the stream yet)
//   async-sync  the same, registered after the stream synchronized
//   pool        cuMemAllocFromPoolAsync from a cuMemPoolCreate pool, after a synchronize
//   vmm         cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess
//   pinned      cuMemHostAlloc (DEVICEMAP), the heap at its device pointer
//   managed     cuMemAllocManaged (global)
#include <cuda.h>
#include <nvtx3/nvToolsExtMem.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  const char* ptx_path = argc > 1 ? argv[1] : "kernel.ptx";
  const char* kind = argc > 2 ? argv[2] : "alloc";
  FILE* f = fopen(ptx_path, "rb");
  if (!f) { perror(ptx_path); return 2; }
  static char ptx[1 << 20];
  size_t n = fread(ptx, 1, sizeof ptx - 1, f);
  ptx[n] = 0;
  fclose(f);
  CUdevice dev; CUcontext ctx; CUmodule mod; CUfunction fn; CUdeviceptr base;
  if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) return 3;
  if (cuModuleLoadData(&mod, ptx) || cuModuleGetFunction(&fn, mod, "probe_write")) return 4;
  CUstream stream;
  cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
  const size_t bytes = !strcmp(kind, "alloc4k") ? 4096 : 2 << 20;
  CUresult r = CUDA_SUCCESS;
  if (!strcmp(kind, "alloc") || !strcmp(kind, "alloc4k")) {
    r = cuMemAlloc(&base, bytes);
  } else if (!strcmp(kind, "async") || !strcmp(kind, "async-sync")) {
    r = cuMemAllocAsync(&base, bytes, stream);
    if (!strcmp(kind, "async-sync")) cuStreamSynchronize(stream);
  } else if (!strcmp(kind, "pool")) {
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    CUmemoryPool pool;
    r = cuMemPoolCreate(&pool, &props);
    if (!r) r = cuMemAllocFromPoolAsync(&base, bytes, pool, stream);
    cuStreamSynchronize(stream);
  } else if (!strcmp(kind, "vmm")) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h;
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = cuMemCreate(&h, bytes, &prop, 0);
    if (!r) r = cuMemAddressReserve(&base, bytes, 0, 0, 0);
    if (!r) r = cuMemMap(base, bytes, 0, h, 0);
    if (!r) r = cuMemSetAccess(base, bytes, &access, 1);
  } else if (!strcmp(kind, "pinned")) {
    void* host = 0;
    r = cuMemHostAlloc(&host, bytes, CU_MEMHOSTALLOC_DEVICEMAP);
    if (!r) r = cuMemHostGetDevicePointer(&base, host, 0);
  } else if (!strcmp(kind, "managed")) {
    r = cuMemAllocManaged(&base, bytes, CU_MEM_ATTACH_GLOBAL);
  } else {
    fprintf(stderr, "unknown kind %s\n", kind);
    return 2;
  }
  if (r) { fprintf(stderr, "probe drv %s: allocation failed: %d\n", kind, (int)r); return 4; }
  nvtxDomainHandle_t domain = nvtxDomainCreateA("probe");
  nvtxMemVirtualRangeDesc_t heap_range = {bytes, (void*)base};
  nvtxMemHeapDesc_t hd;
  memset(&hd, 0, sizeof hd);
  hd.extCompatID = NVTX_EXT_COMPATID_MEM;
  hd.structSize = sizeof hd;
  hd.usage = NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR;
  hd.type = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  hd.typeSpecificDescSize = sizeof heap_range;
  hd.typeSpecificDesc = &heap_range;
  nvtxMemHeapHandle_t heap = nvtxMemHeapRegister(domain, &hd);
  nvtxMemVirtualRangeDesc_t region = {1000 * sizeof(float), (void*)base};
  nvtxMemRegionsRegisterBatch_t rb;
  memset(&rb, 0, sizeof rb);
  rb.extCompatID = NVTX_EXT_COMPATID_MEM;
  rb.structSize = sizeof rb;
  rb.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  rb.heap = heap;
  rb.regionCount = 1;
  rb.regionDescElementSize = sizeof region;
  rb.regionDescElements = &region;
  nvtxMemRegionsRegister(domain, &rb);
  printf("probe drv %s: base %p heap %p\n", kind, (void*)base, (void*)heap);
  fflush(stdout);
  int count = 1000, extra = bytes == 4096 ? 24 : 256;
  void* args[] = {&base, &count, &extra};
  if (cuLaunchKernel(fn, 5, 1, 1, 256, 1, 1, 0, stream, args, 0)) return 5;
  cuCtxSynchronize();
  nvtxMemHeapUnregister(domain, heap);
  printf("probe drv %s: done\n", kind);
  return 0;
}
