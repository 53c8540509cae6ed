#!/usr/bin/env bash
# counting-layout.sh: Counting<Global> against Global at 256 B (issue 22 item 1) in
# ordinary processes and in processes without address randomization (`setarch -R`),
# alternating, so that the layout-dependent slow mode (BENCHMARKS.md, 2026-12-06 third
# session) shows beside the ordinary runs of the same binary.
#
#   tools/counting-layout.sh [AB] [N]     (AB = target/release/examples/ab, N = 3 pairs)
#
# Prints, per process, the 256 B rows of `ab --only latency`: the first table's
# Global / Counting and the interleaved table's one-thread and eight-thread pairs.
# On the GPU machine: `bash tools/counting-layout.sh .gpu/example-ab`.
set -euo pipefail
cd "$(dirname "$0")/.."
ab=${1:-target/release/examples/ab}
n=${2:-3}
[[ -x $ab ]] || { echo "counting-layout: no $ab (cargo build --release --example ab)" >&2; exit 2; }
command -v setarch >/dev/null || { echo "counting-layout: setarch not found" >&2; exit 2; }
printf '%-9s %-32s %-32s %s\n' layout "first table: Global / Counting" "1 thread: Global / Counting" "8 threads: Global / Counting"
for ((i = 1; i <= n; i++)); do
  for layout in ordinary fixed; do
    pre=()
    [[ $layout == fixed ]] && pre=(setarch "$(uname -m)" -R)
    "${pre[@]}" "$ab" --only latency 2>&1 | awk -F'|' -v l="$layout" '
      /^\|  256 B/ { gsub(/ +/, " "); row[++k] = $3 "/" $4; if (k == 2) r8 = $6 "/" $7 }
      END { printf "%-9s %-32s %-32s %s\n", l, row[1], row[2], r8 }'
  done
done
