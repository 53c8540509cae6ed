#!/usr/bin/env bash
# gpu-sanitize.sh: compute-sanitizer memcheck (with the leak check) over the staged test
# executables, on the GPU machine.
#
#   here:                ../shared/tools/gpu-stage --features test-hooks
#   on the GPU machine:  bash tools/gpu-sanitize.sh [.gpu] [-- extra test arguments]
#
# Each .gpu/test-* runs alone, with --test-threads=1 (one test at a time: the sanitizer
# serializes the device anyway, and each test thread exits, flushing its caches, before
# the next test starts) and REQUIRE_GPU=1 (a GPU test that would skip fails instead):
#
#   compute-sanitizer --tool memcheck --leak-check full --report-api-errors no \
#       --error-exitcode 1 --log-file .gpu/sanitize/NAME.log ./test-NAME --test-threads=1
#
# API errors are not reported (`--report-api-errors no`): the tests provoke them on
# purpose (malformed PTX, a range registered twice, requests larger than the device, a
# pointer query on memory CUDA does not know), and each is checked by its test. Memory
# errors (out-of-bounds and misaligned accesses, ...) and leaks are what this run is for.
#
# Leaks: the pools keep freed blocks for reuse, which `--leak-check full` reports as
# leaked at exit. The integration tests return them before exit: the first GPU test of a
# binary registers an exit hook that calls `cudalloc::release_cached_memory()` (see
# `tests/all/support.rs`, shared with tests/gated.rs). Set CUDALLOC_TEST_KEEP_CACHE=1 to
# see what is left without it.
#
# SANITIZE_ONLY="all gated" limits the run to those binaries (.gpu/test-all, ...), to
# stay within a time limit per command. PROPTEST_CASES defaults to 32 here: under the
# sanitizer what matters is the CUDA calls, not ten thousand host-only cases.
#
# Prints one line per binary (errors, leaks, test result) and exits 1 if any binary had
# a sanitizer error, a leak, or a failing test. Logs stay in .gpu/sanitize/.
set -uo pipefail
dir=.gpu
if [[ $# -gt 0 && $1 != -- ]]; then
  dir=$1
  shift
fi
[[ ${1:-} == -- ]] && shift
cd "$dir" || { echo "gpu-sanitize: no folder $dir (run gpu-stage first)" >&2; exit 2; }
command -v compute-sanitizer >/dev/null ||
  PATH=$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer
command -v compute-sanitizer >/dev/null || { echo "gpu-sanitize: compute-sanitizer not found" >&2; exit 2; }
mkdir -p sanitize
export REQUIRE_GPU=1 RUST_BACKTRACE=1 PROPTEST_CASES=${PROPTEST_CASES:-32}
status=0
summary=()
for t in ./test-*; do
  name=${t#./test-}
  if [[ -n ${SANITIZE_ONLY:-} && " $SANITIZE_ONLY " != *" $name "* ]]; then
    continue
  fi
  log=sanitize/$name.log
  out=sanitize/$name.out
  start=$SECONDS
  compute-sanitizer --tool memcheck --leak-check full --report-api-errors no --error-exitcode 1 \
    --log-file "$log" "$t" --test-threads=1 "$@" >"$out" 2>&1
  rc=$?
  errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$log" | grep -Eo '[0-9]+' | tail -1)
  # A binary that never calls CUDA (host-only tests): the sanitizer has nothing to check
  # and exits 255; what counts then is the tests' own result.
  if grep -q 'terminated before first instrumented API call' "$log"; then
    errors=0
    if grep -Eq '^test result: ok|passed, 0 failed' "$out"; then rc=0; fi
    name="$name (no CUDA)"
  fi
  leaks=$(grep -c 'Leaked [0-9]* bytes' "$log")
  result=$(grep -E '^test result:|passed, [0-9]+ failed' "$out" | tail -1)
  line=$(printf '%-22s rc %-3s sanitizer errors %-4s leaks %-4s %4ss  %s' \
    "$name" "$rc" "${errors:-?}" "$leaks" "$((SECONDS - start))" "${result:-(no test summary)}")
  echo "$line"
  summary+=("$line")
  if [[ $rc -ne 0 || ${errors:-1} -ne 0 || $leaks -ne 0 ]]; then
    status=1
    grep -E '^=========  *(Invalid|Leaked|Program hit|Saved host backtrace|Host Frame)' "$log" | head -20
  fi
done
echo
echo "=== compute-sanitizer memcheck summary (logs in $dir/sanitize/)"
printf '%s\n' "${summary[@]}"
exit $status
