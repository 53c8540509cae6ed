#!/usr/bin/env bash
# Regenerates kernels/*.ptx from kernels/*.cu. The crate never compiles CUDA at build or
# run time: the PTX text is committed beside its source and loaded by the driver
# (cuModuleLoadData), which JIT-compiles it for the GPU at hand.
#
# Toolkit: CUDA 13.0's nvcc, the release the GPU machine has (13.0.88). Without a local
# toolkit, NVIDIA's wheels provide it (no root needed):
#   pip download --no-deps -d /tmp/w 'nvidia-cuda-nvcc==13.0.*' 'nvidia-nvvm==13.0.*' \
#       'nvidia-cuda-crt==13.0.*' 'nvidia-cuda-runtime==13.0.*'
#   mkdir -p /tmp/nvcc13 && for w in /tmp/w/*.whl; do unzip -q -o "$w" -d /tmp/nvcc13; done
#   PATH=/tmp/nvcc13/nvidia/cu13/bin:$PATH kernels/build-ptx.sh
#
# Target and ISA version: `sm_75` is the oldest architecture CUDA 13 compiles for; the
# driver JIT-compiles it forward for newer GPUs (an H200 is sm_90). nvcc 13.0 writes
# `.version 9.0`, which only drivers of CUDA 13.0 and later load (an older driver refuses
# it with CUDA_ERROR_UNSUPPORTED_PTX_VERSION); these kernels use nothing newer than PTX ISA
# 8.0, so the header is lowered to 8.0, which every CUDA 12 and 13 driver loads.
set -euo pipefail
cd "$(dirname "$0")"
command -v nvcc >/dev/null || { echo "build-ptx: nvcc not found (see the comment at the top)" >&2; exit 1; }
for cu in *.cu; do
  ptx="${cu%.cu}.ptx"
  nvcc -ptx -arch=sm_75 -O3 -o "$ptx" "$cu"
  sed -i 's/^\.version 9\.0$/.version 8.0/' "$ptx"
  grep -q '^\.version 8\.0$' "$ptx" || { echo "build-ptx: unexpected .version in $ptx" >&2; exit 1; }
  echo "$ptx: $(nvcc --version | tail -1)"
done
