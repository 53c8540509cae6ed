// y = a * x + y over n floats, one thread per element: the kernel of examples/cudarc.rs.
// Compiled to PTX once (kernels/build-ptx.sh); the program loads saxpy.ptx at run time.
extern "C" __global__ void saxpy(float a, const float* __restrict__ x, float* __restrict__ y,
                                 unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = a * x[i] + y[i];
    }
}
