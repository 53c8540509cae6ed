#!/usr/bin/env bash
# gpu-issue-checks.sh: the H200 checks of the 2026-12-01 issues that are not plain test
# runs: the release at exit under compute-sanitizer (issue 21 item 12, with its negative
# control and the sign the crate detects), PyTorch's memory_viz on a snapshot the crate
# wrote (issue 20), and the replay of the sample traces on the GPU (issue 20).
#
#   here:                ../shared/tools/gpu-stage --features cudarc,test-hooks
#   on the GPU machine:  bash tools/gpu-issue-checks.sh   (writes logs to $OUT or .gpu/checks)
set -uo pipefail
out=${OUT:-.gpu/checks}
mkdir -p "$out"
command -v compute-sanitizer >/dev/null ||
  PATH=$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer
export REQUIRE_GPU=1 RUST_BACKTRACE=1

echo "=== the sign of compute-sanitizer in the environment"
compute-sanitizer --print-level error /usr/bin/env 2>/dev/null | grep -iE 'CUDA_INJECTION64_PATH|NV_SANITIZER' | sed 's/=.*\//=...\//'

t=device::cached_memory_left_for_the_release_at_exit
for mode in default off; do
  echo "=== release at exit under compute-sanitizer --leak-check full ($mode)"
  extra=()
  [[ $mode == off ]] && extra=(env CUDALLOC_RELEASE_AT_EXIT=0)
  CUDALLOC_TEST_KEEP_CACHE=1 "${extra[@]}" compute-sanitizer --tool memcheck --leak-check full \
    --report-api-errors no --log-file "$out/release-$mode.log" .gpu/test-all --exact "$t" --test-threads=1 \
    > "$out/release-$mode.out" 2>&1
  grep -E "test result" "$out/release-$mode.out"
  grep -E "LEAK SUMMARY|ERROR SUMMARY|Leaked [0-9]+ bytes" "$out/release-$mode.log" | sort | uniq -c | head -5
done

echo "=== PyTorch's memory_viz on a snapshot the crate wrote"
REQUIRE_TORCH=1 .gpu/test-all trace_formats::torch --test-threads=1 2>&1 | grep -E "^test |test result"

echo "=== sample traces replayed on the GPU"
for f in traces/rmm_random.csv traces/vec_growth.pickle; do
  timeout 200 .gpu/example-replay "$f" --fit --json "$out/$(basename "$f").json" 2>&1 | tail -40
done
