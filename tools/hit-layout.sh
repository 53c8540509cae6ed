#!/usr/bin/env bash
# hit-layout.sh: the device pool's hit pair (issue 23, `device_hit/cache` and `cache_ptr`)
# in ordinary processes and in processes without address randomization (`setarch -R`),
# alternating, to see whether the hit's process-to-process spread (8-10 ns with one
# binary on the H100 VM, BENCHMARKS.md 2026-12-07) follows the address layout as the
# counting allocator's does (tools/counting-layout.sh).
#
#   on the GPU machine:  bash tools/hit-layout.sh [BENCH] [N]
#                        (BENCH = .gpu/bench-device, N = 4 pairs; carry [".gpu"])
#
# Prints, per process, the bench's line of batch medians (median / fastest of 200 batches
# of 10^4 pairs at every size) and its line of the hit against a 64-byte `malloc` in
# alternating batches (with the median ratio), and appends them to $OUT/hit-layout.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
bench=${1:-.gpu/bench-device}
n=${2:-4}
out=${OUT:-.gpu}/hit-layout.txt
[[ -x $bench ]] || { echo "hit-layout: no $bench (../shared/tools/gpu-stage)" >&2; exit 2; }
command -v setarch >/dev/null || { echo "hit-layout: setarch not found" >&2; exit 2; }
for ((i = 1; i <= n; i++)); do
  for layout in ordinary fixed; do
    pre=()
    [[ $layout == fixed ]] && pre=(setarch "$(uname -m)" -R)
    lines=$(timeout 90 "${pre[@]}" "$bench" --bench 'device_hit/cache_ptr' --warm-up-time 0.2 \
      --measurement-time 0.4 --sample-size 10 2>&1 | grep -E 'per pair|alternating' || echo "no result")
    while IFS= read -r line; do
      what=medians
      [[ $line == *alternating* ]] && what="against malloc"
      echo "$layout $i, $what: ${line#*: }" | tee -a "$out"
    done <<< "$lines"
  done
done
