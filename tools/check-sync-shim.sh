#!/usr/bin/env bash
# The loom shim's rule: no file under src/ but src/sync.rs names `std::sync` (comments,
# hence doc examples, and `std::sync::mpsc` channels in tests excepted), so that every
# lock and atomic is loom's under `--cfg loom`. Run by .ci/run; exits 1 and lists the
# offending lines otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
offenders=$(grep -rn --include='*.rs' 'std::sync' src \
  | grep -v '^src/sync\.rs:' \
  | grep -v 'std::sync::mpsc' \
  | grep -Ev '^[^:]+:[0-9]+:[[:space:]]*//' || true)
files=$(find src -name '*.rs' | wc -l)
if [ "$files" -le 20 ]; then
  echo "check-sync-shim: found only $files source files under src/" >&2
  exit 1
fi
if [ -n "$offenders" ]; then
  echo "std::sync outside src/sync.rs:" >&2
  echo "$offenders" >&2
  exit 1
fi
echo "check-sync-shim: $files files, std::sync only in src/sync.rs"
