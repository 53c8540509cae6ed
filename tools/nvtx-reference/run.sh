#!/usr/bin/env bash
# run.sh: on the GPU machine, NVIDIA's NVTX headers against compute-sanitizer (probe.cu:
# runtime first, NVTX first; probe_drv.cpp: driver API only, as cudalloc), then the same
# probes and cudalloc's own sanitizer test through spy.so, which logs the handshake each
# side makes with the tool. Logs in $OUT (or /tmp/nvtx-reference).
#   bash tools/nvtx-reference/run.sh [TEST_BINARY]    (default .gpu/test-all)
# NVTX_INCLUDE: a directory holding nvtx3/ if the toolkit's has no nvToolsExtMem.h.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/nvtx-reference}
bin=$out/build
mkdir -p "$bin"
PATH=$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer
inc=/usr/local/cuda/include
[[ -f $inc/nvtx3/nvToolsExtMem.h ]] || inc=${NVTX_INCLUDE:-}
[[ -f $inc/nvtx3/nvToolsExtMem.h ]] || { echo "no nvtx3/nvToolsExtMem.h (set NVTX_INCLUDE)"; exit 2; }
echo "headers: $inc/nvtx3 ($(grep -m1 -o 'NVTX_EXT_COMPATID_MEM 0x[0-9A-Fa-f]*' "$inc/nvtx3/nvToolsExtMem.h"))"
compute-sanitizer --version | tail -1
nvcc -O1 -I"$inc" -o "$bin/probe" "$here/probe.cu" || exit 2
nvcc -ptx -o "$bin/kernel.ptx" "$here/kernel.cu" || exit 2
nvcc -x c++ -O1 --cudart none -I"$inc" -o "$bin/probe_drv" "$here/probe_drv.cpp" -lcuda || exit 2
gcc -shared -fPIC -O1 -o "$bin/spy.so" "$here/spy.c" -ldl || exit 2

verdict() {
  printf '%-10s %-22s invalid-write lines %s\n' "$1" \
    "$(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?' "$out/$1.log" | tail -1)" \
    "$(grep -c 'Invalid __global__ write' "$out/$1.log")"
}
plain() {
  local name=$1; shift
  compute-sanitizer --tool memcheck --log-file "$out/$name.log" "$@" > "$out/$name.out" 2>&1
  verdict "$name"
}
spied() {
  local name=$1; shift
  compute-sanitizer --tool memcheck --log-file "$out/$name.log" bash -c \
    'SPY_REAL=$NVTX_INJECTION64_PATH NVTX_INJECTION64_PATH='"$bin/spy.so"' exec "$@"' _ "$@" \
    > "$out/$name.out" 2>&1
  verdict "$name"
  grep -E '^spy|nvtx status|attached|pipeline_hash' "$out/$name.out" | grep -v 'mem slots' | sed 's/^/    /' | head -${SPY_LINES:-40}
}
echo "=== the tool's environment in the child"
compute-sanitizer --tool memcheck bash -c 'env | grep -iE "nvtx|inject|sanitizer" | sort' 2>&1 | grep -v '^=' | head
echo "=== NVIDIA's headers"
plain rt "$bin/probe" rt
plain early "$bin/probe" early
plain msg "$bin/probe" msg
for kind in ${PROBE_KINDS:-alloc alloc4k async async-sync pool vmm pinned managed}; do
  plain "drv-$kind" "$bin/probe_drv" "$bin/kernel.ptx" "$kind"
  grep -h 'probe drv' "$out/drv-$kind.out" | sed 's/^/    /'
done
echo "=== the handshakes, through spy.so"
spied spy-rt "$bin/probe" rt
spied spy-drv "$bin/probe_drv" "$bin/kernel.ptx" alloc
test_bin=${1:-.gpu/test-all}
if [[ -x $test_bin ]]; then
  for t in ${SPY_TESTS:-sanitizer_write_past_a_small_pooled_buffer}; do
    spied "spy-rust-$t" env SPY_CALLS=1 CUDALLOC_SANITIZER_TESTS=1 REQUIRE_GPU=1 RUST_BACKTRACE=1 \
      "$test_bin" --exact "nvtx::$t" --test-threads=1 --nocapture
    grep -E 'panicked|Warning|Error' "$out/spy-rust-$t.out" "$out/spy-rust-$t.log" | head -8 | sed 's/^/    /'
  done
fi
