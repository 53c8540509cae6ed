// probe.cu: NVIDIA's own NVTX headers against compute-sanitizer, the reference for
// src/cuda/nvtx.rs. One 1 MiB cudaMalloc registered as a heap, one region of 1000 floats
// live, a kernel writing 256 floats past it. MODE (argv[1]):
//   rt     CUDA runtime initialized first (cudaFree(0)), as the sanitizer's guide asks
//   early  the NVTX calls before any CUDA call (the guide says: not allowed)
//   msg    as rt, the heap described with an ASCII message
// A report of "Invalid __global__ write" means the sanitizer saw the heap and region.
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExtMem.h>
#include <cstdio>
#include <cstring>
#include "kernel.cu"

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "rt";
  bool early = !strcmp(mode, "early");
  nvtxDomainHandle_t domain = nullptr;
  if (early) domain = nvtxDomainCreateA("probe");
  else { cudaFree(0); domain = nvtxDomainCreateA("probe"); }
  float* base = nullptr;
  cudaMalloc(&base, 1 << 20);
  nvtxMemVirtualRangeDesc_t heap_range = {1 << 20, base};
  nvtxMemHeapDesc_t hd;
  memset(&hd, 0, sizeof hd);
  hd.extCompatID = NVTX_EXT_COMPATID_MEM;
  hd.structSize = sizeof hd;
  hd.usage = NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR;
  hd.type = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  hd.typeSpecificDescSize = sizeof heap_range;
  hd.typeSpecificDesc = &heap_range;
  if (!strcmp(mode, "msg")) {
    hd.messageType = NVTX_MESSAGE_TYPE_ASCII;
    hd.message.ascii = "probe heap";
  }
  nvtxMemHeapHandle_t heap = nvtxMemHeapRegister(domain, &hd);
  nvtxMemVirtualRangeDesc_t region = {1000 * sizeof(float), base};
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
  printf("probe %s: domain %p heap %p\n", mode, (void*)domain, (void*)heap);
  printf("probe %s: pipeline_hash writing past the region\n", mode);
  probe_write<<<5, 256>>>(base, 1000, 256);
  cudaDeviceSynchronize();
  nvtxMemHeapUnregister(domain, heap);
  cudaFree(base);
  return 0;
}
