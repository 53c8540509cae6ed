#!/usr/bin/env bash
# gpu-verify.sh: the device pool's verification in one GPU call, most needed first, each
# part's output appended as it comes, so that a call cut short by its time limit still
# brings back what finished: every staged test (REQUIRE_GPU=1), the hit pair
# (`device_hit/cache`), RMM's random workload against its peers (`device_random/none`), the
# sample traces replayed on every backing (`example-replay --rounds 5`: each row the median
# of five alternating replays), the hit again (a second
# process), and the traces on PyTorch's and CuPy's allocators (`tools/peers_replay.py`).
#
#   here:                ../shared/tools/gpu-stage --features cudarc,test-hooks
#                        (copy any extra traces into .gpu/x/ after staging: it wipes .gpu)
#   on the GPU machine:  bash tools/gpu-verify.sh [EXTRA_TRACE...]   (carry [".gpu"])
#
# Writes $OUT/gpu-verify.txt (or .gpu/gpu-verify.txt without $OUT) and exits with the
# tests' status.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.gpu}/gpu-verify.txt
traces=(traces/rmm_random.csv traces/pipeline.csv "$@")
log() { tee -a "$out"; }
hit() {
  echo "##### device_hit/cache, process $1 $(date +%T)"
  .gpu/bench-device --bench 'device_hit/cache' --warm-up-time 0.3 --measurement-time 0.7 \
    --sample-size 10 2>&1 | grep --line-buffered -E 'per pair|time:|^device_hit' |
    grep --line-buffered -v Benchmarking
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out"
echo "##### tests $(date +%T)" | log
bash .gpu/run-tests 2>&1 | grep --line-buffered -E '^=== |test result|FAILED|panicked' | log
rc=${PIPESTATUS[0]}
echo "rc $rc" | log
hit 1 | log
echo "##### device_random/none $(date +%T)" | log
timeout 150 .gpu/bench-device --bench device_random/none 2>&1 |
  grep --line-buffered -vE '^Benchmarking|^$|Found|outlier|high|low' | log
for t in "${traces[@]}"; do
  echo "##### replay $t $(date +%T)" | log
  timeout 120 .gpu/example-replay "$t" --rounds 5 2>&1 | grep -E '^\|' | log
done
hit 2 | log
for t in "${traces[@]}"; do
  echo "##### peers $t $(date +%T)" | log
  timeout 120 python3 tools/peers_replay.py "$t" 2>&1 | grep -E '^\||rror' | log
done
echo "##### done $(date +%T)" | log
exit "$rc"
