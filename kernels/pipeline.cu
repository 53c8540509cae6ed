// The kernel of examples/pipeline.rs: out[i] = f^rounds(in[i]) for n 32-bit words, so the
// work per byte is a parameter (`rounds`) and a transfer-bound, balanced or compute-bound
// pipeline is one argument apart. f is an integer mix (multiply-add, xor-shift) that the
// host reproduces exactly (`hash_rounds` in examples/common/pipeline.rs): every output can
// be checked bit for bit. Grid-stride loop: any grid size covers any n.
//
// Regenerate pipeline.ptx with kernels/build-ptx.sh (CUDA 13.0's nvcc, PTX ISA 8.0).

extern "C" __global__ void pipeline_hash(const unsigned int* __restrict__ in,
                                         unsigned int* __restrict__ out,
                                         unsigned long long n,
                                         unsigned int rounds)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        unsigned int x = in[i];
        for (unsigned int r = 0; r < rounds; ++r) {
            x = x * 0x9E3779B1u + 0x7F4A7C15u;
            x ^= x >> 15;
        }
        out[i] = x;
    }
}
