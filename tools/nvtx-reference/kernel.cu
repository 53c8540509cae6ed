// The kernel both probes launch: writes n + extra floats from p (extra past a region of n).
extern "C" __global__ void probe_write(float* p, int n, int extra) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n + extra) p[i] = 1.0f;
}
