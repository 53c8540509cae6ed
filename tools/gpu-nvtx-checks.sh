#!/usr/bin/env bash
# gpu-nvtx-checks.sh: issue 24 on the GPU machine: compute-sanitizer memcheck reports the
# memory errors the tests `nvtx::sanitizer_*` make in pooled memory (device pools and
# arenas; pinned and managed host pools and arenas), and does not with the annotations off
# (the negative control, CUDALLOC_NVTX=0); then the fake-tool balance tests on the real
# pools, and (unless NVTX_CHECKS_SUITE=0) the whole staged suite under memcheck
# (tools/gpu-sanitize.sh: 0 errors, 0 leaks with the annotations on).
#
#   here:                ../shared/tools/gpu-stage --features cudarc,test-hooks
#   on the GPU machine:  bash tools/gpu-nvtx-checks.sh   (logs in $OUT or .gpu/nvtx)
#
# Each check prints PASS or FAIL with the line that decides it; the script exits 1 if any
# failed. A report must name the kernel (pipeline_hash) and be an invalid access.
set -uo pipefail
out=${OUT:-.gpu/nvtx}
mkdir -p "$out"
command -v compute-sanitizer >/dev/null ||
  PATH=$PATH:/usr/local/cuda/bin:/usr/local/cuda/compute-sanitizer
command -v compute-sanitizer >/dev/null || { echo "gpu-nvtx-checks: compute-sanitizer not found" >&2; exit 2; }
[[ -x .gpu/test-all ]] || { echo "gpu-nvtx-checks: no .gpu/test-all (run gpu-stage first)" >&2; exit 2; }
export REQUIRE_GPU=1 RUST_BACKTRACE=1
compute-sanitizer --version | tail -1
status=0

# Device memory, then host memory the sanitizer was measured to take as a heap
# (cuMemHostAlloc with DEVICEMAP, managed memory: tools/nvtx-reference/ kinds `pinned`,
# `managed`): each must be reported with the annotations on.
tests=(
  sanitizer_write_past_a_small_pooled_buffer
  sanitizer_write_past_a_large_page_backed_buffer
  sanitizer_write_past_a_large_driver_pool_buffer
  sanitizer_write_into_a_dropped_buffer
  sanitizer_write_past_an_arena_slice
  sanitizer_write_into_an_arena_after_reset
  sanitizer_write_past_a_pinned_pool_vec
  sanitizer_write_past_a_large_pinned_pool_vec
  sanitizer_write_into_a_freed_pinned_block
  sanitizer_write_past_a_managed_vec
  sanitizer_write_into_a_freed_managed_block
  sanitizer_write_past_a_pinned_arena_block
  sanitizer_write_into_a_pinned_arena_after_reset
)
# Host memory not measured yet: PinnedAlloc's registered chunks (the default growth) and
# its cuMemHostAlloc chunks without DEVICEMAP. The test prints whether the tool took the
# block's chunk as a heap ("nvtx heap: Some"); if it did, the write must be reported
# (PASS/FAIL), if not the block is invisible and the line says INFO (not a failure).
probes=(
  "sanitizer_write_past_a_pinned_alloc_vec"
  "sanitizer_write_past_a_pinned_alloc_vec CUDALLOC_PINNED_GROWTH=hostalloc"
)

# check TEST PROBE [VAR=VALUE...]: TEST under memcheck with the annotations on and off.
check() {
  local t=$1 probe=$2
  shift 2
  local tag=$t
  [[ $# -gt 0 ]] && tag=$t-$(echo "$*" | tr -c 'A-Za-z0-9_\n' '-')
  for mode in on off; do
    local log=$out/$tag-$mode.log
    local extra=("$@")
    [[ $mode == off ]] && extra+=(CUDALLOC_NVTX=0)
    env CUDALLOC_SANITIZER_TESTS=1 "${extra[@]}" compute-sanitizer --tool memcheck \
      --report-api-errors no --log-file "$log" .gpu/test-all --exact "nvtx::$t" \
      --test-threads=1 --nocapture > "$out/$tag-$mode.out" 2>&1
    local errors invalid named ran heap verdict want
    errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$log" | grep -Eo '[0-9]+' | tail -1)
    invalid=$(grep -cE 'Invalid __global__ (write|read)' "$log")
    named=$(grep -c 'pipeline_hash' "$log")
    ran=$(grep -c 'pipeline_hash writing' "$out/$tag-$mode.out")
    heap=$(grep -c 'nvtx heap: Some' "$out/$tag-$mode.out")
    if [[ $mode == on ]]; then
      verdict=FAIL
      [[ $ran -ge 1 && ${errors:-0} -gt 0 && $invalid -gt 0 && $named -gt 0 ]] && verdict=PASS
      want="reported"
      if [[ $probe == probe && $heap -eq 0 && $ran -ge 1 ]]; then
        verdict=INFO
        want="invisible: no heap taken"
      fi
    else
      verdict=FAIL
      [[ $ran -ge 1 && ${errors:-1} -eq 0 ]] && verdict=PASS
      want="not reported (CUDALLOC_NVTX=0)"
    fi
    [[ $verdict == FAIL ]] && status=1
    printf '%-4s %-50s %-3s want %-30s errors %-4s invalid-access lines %-4s kernel named %s %s\n' \
      "$verdict" "$t" "$mode" "$want" "${errors:-?}" "$invalid" "$named" "$*"
    grep -m1 -E 'nvtx heap:' "$out/$tag-$mode.out" | sed 's/^/       /'
    if [[ $mode == on ]]; then
      grep -m1 -E 'Invalid __global__' "$log" | sed 's/^/       /'
      grep -m1 -E 'at pipeline_hash' "$log" | sed 's/^/       /'
      grep -m1 -E 'is out of bounds|bytes (after|before|inside)' "$log" | sed 's/^/       /'
    fi
  done
}

for t in "${tests[@]}"; do
  check "$t" must
done
for p in "${probes[@]}"; do
  # shellcheck disable=SC2086 # a test name, then VAR=VALUE words
  check ${p%% *} probe $([[ $p == *' '* ]] && echo "${p#* }")
done

# initcheck (reads of bytes no one wrote) over pooled memory, annotations on and off. A
# block fresh from the driver must be reported either way (the tool tracks the driver's
# allocation, never written); a block the cache hands out again, which its previous owner
# wrote, must be reported with the annotations (registering a region makes its bytes
# uninitialized to the tool: measured on the H200, compute-sanitizer 2025.3.1) and is not
# without them (INFO). The run with --track-unused-memory only says what it reports (INFO).
# With `unused` as a second argument, also --track-unused-memory yes (unused bytes of
# allocations reported at exit: with the annotations, only those inside live regions).
initcheck() {
  local t=$1 flags=()
  [[ ${2:-} == unused ]] && flags=(--track-unused-memory)
  for mode in on off; do
    local tag=initcheck-$t${2:+-$2}-$mode
    local log=$out/$tag.log extra=()
    [[ $mode == off ]] && extra+=(CUDALLOC_NVTX=0)
    env CUDALLOC_SANITIZER_TESTS=1 "${extra[@]}" compute-sanitizer --tool initcheck "${flags[@]}" \
      --log-file "$log" .gpu/test-all --exact "nvtx::$t" --test-threads=1 --nocapture \
      > "$out/$tag.out" 2>&1
    local errors uninit unused ran verdict=INFO
    errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$log" | grep -Eo '[0-9]+' | tail -1)
    uninit=$(grep -c 'Uninitialized __global__ memory read' "$log")
    unused=$(grep -ci 'unused memory' "$log")
    ran=$(grep -c 'pipeline_hash reading' "$out/$tag.out")
    if [[ -z ${2:-} && ( $t == initcheck_read_of_a_fresh_pooled_block || $mode == on ) ]]; then
      verdict=FAIL
      [[ $ran -ge 1 && $uninit -gt 0 ]] && verdict=PASS
      [[ $verdict == FAIL ]] && status=1
    fi
    [[ $ran -ge 1 ]] || { verdict=FAIL; status=1; }
    printf '%-4s initcheck %-52s %-3s %s errors %-4s uninitialized-read lines %-4s unused-memory lines %s\n' \
      "$verdict" "$t" "$mode" "${flags[*]}" "${errors:-?}" "$uninit" "$unused"
    grep -m1 -E 'Uninitialized __global__' "$log" | sed 's/^/       /'
    grep -m2 -iE 'unused memory' "$log" | sed 's/^/       /'
  done
}
initcheck initcheck_read_of_a_fresh_pooled_block
initcheck initcheck_read_of_a_recycled_block_its_last_owner_wrote
initcheck initcheck_read_of_a_recycled_block_its_last_owner_wrote unused

echo "=== the fake tool on the host pools and arenas (pinned, managed, registered; no sanitizer)"
if .gpu/test-all --exact nvtx::pinned_and_managed_pools_and_arenas_register_exact_regions_and_balance \
  --test-threads=1 --nocapture > "$out/host-balance.out" 2>&1 && grep -q '1 passed' "$out/host-balance.out"; then
  echo "PASS registers and unregisters balance"
  grep -E 'mapped at its address' "$out/host-balance.out" | sed 's/^/       /'
else
  echo "FAIL"; tail -30 "$out/host-balance.out"; status=1
fi

echo "=== the fake tool on DevicePool (both backings) and DeviceArena (no sanitizer)"
if .gpu/test-all --exact nvtx::device_pools_and_arenas_register_exact_regions_and_balance \
  --test-threads=1 > "$out/balance.out" 2>&1 && grep -q '1 passed' "$out/balance.out"; then
  echo "PASS registers and unregisters balance"
else
  echo "FAIL"; tail -30 "$out/balance.out"; status=1
fi

if [[ ${NVTX_CHECKS_SUITE:-1} != 0 ]]; then
  echo "=== the whole staged suite under memcheck, annotations on (tools/gpu-sanitize.sh)"
  bash "$(dirname "$0")/gpu-sanitize.sh" .gpu || status=1
fi
exit $status
