#!/usr/bin/env bash
# hit-instructions.sh: instructions per hit pair of each hot path, counted by callgrind
# (the same count for the same binary and input however busy the machine is), as the
# difference between runs of 2N and N pairs of `examples/hit_instructions.rs`; then the
# same paths built with `--cfg cudalloc_no_nvtx` (the NVTX annotations compiled out).
#
#   tools/hit-instructions.sh [N]      (N = 100000; needs valgrind)
#
# Builds into target/hit-instructions{,-no-nvtx} so the ordinary build is untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-100000}
command -v valgrind >/dev/null || { echo "hit-instructions: valgrind not found" >&2; exit 2; }
refs() { valgrind --tool=callgrind --callgrind-out-file=/dev/null "$@" 2>&1 | awk '/I *refs:/ {gsub(",", "", $NF); print $NF}'; }
for build in annotations no-nvtx; do
  dir=target/hit-instructions
  flags=""
  [[ $build == no-nvtx ]] && { dir=target/hit-instructions-no-nvtx; flags="--cfg cudalloc_no_nvtx"; }
  RUSTFLAGS="$flags" CARGO_TARGET_DIR=$dir cargo build --release --quiet --example hit_instructions
  bin=$dir/release/examples/hit_instructions
  for path in system counting host_pool device_sim device_sim_bare; do
    a=$(refs "$bin" "$path" "$n")
    b=$(refs "$bin" "$path" "$((2 * n))")
    printf '%-12s %-16s %6.1f instructions per pair\n' "$build" "$path" "$(echo "($b - $a) / $n" | bc -l)"
  done
done
