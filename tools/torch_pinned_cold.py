#!/usr/bin/env python3
"""Cold pinned growth of PyTorch's caching host allocator, measured as `ab --only cold`
measures cudalloc's (issue 22.6): each figure is a fresh process that first brings up CUDA
and the allocator with a 1-byte pinned tensor, then times the first
`torch.empty(size, dtype=torch.uint8, pin_memory=True)` and then `fill_(1)` on it.

    python3 tools/torch_pinned_cold.py [--sizes 64M,256M,1G] [--reps 3] [--json FILE]

Configurations (PYTORCH_CUDA_ALLOC_CONF of the child process):
  default                     cudaHostAlloc
  register, 8 threads         pinned_use_cuda_host_register:True,pinned_num_register_threads:8
Prints a Markdown table with the columns of ab's `cold` table (median of --reps processes).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = [
    ("torch default (cudaHostAlloc)", None),
    (
        "torch register, 8 threads",
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    ),
]

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s):
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1] if s and s[-1] in UNITS else ""
    return int(s[: len(s) - len(unit)]) * UNITS[unit]


def fmt_size(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def child(size):
    import time

    import torch

    torch.cuda.init()
    warm = torch.empty(1, dtype=torch.uint8, pin_memory=True)
    assert warm.is_pinned()
    t = time.perf_counter_ns()
    x = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    first = time.perf_counter_ns() - t
    assert x.is_pinned()
    t = time.perf_counter_ns()
    x.fill_(1)
    fill = time.perf_counter_ns() - t
    print(f"cold-result {first} {fill} torch={torch.__version__}")


def run_child(size, conf):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(size)],
        env=env,
        capture_output=True,
        text=True,
    )
    for line in out.stdout.splitlines():
        if line.startswith("cold-result "):
            first, fill, version = line.split()[1:4]
            return float(first), float(fill), version
    raise RuntimeError(f"child failed ({out.returncode}): {out.stderr.strip()[-2000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64M,256M,1G")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        child(a.child)
        return 0
    rows, failures, version = [], [], "?"
    for size in [parse_size(s) for s in a.sizes.split(",")]:
        for name, conf in CONFIGS:
            runs = []
            for _ in range(a.reps):
                try:
                    first, fill, version = run_child(size, conf)
                    runs.append((first, fill))
                except RuntimeError as e:
                    failures.append(f"{name} {fmt_size(size)}: {e}")
            first = statistics.median(r[0] for r in runs) / 1e6 if runs else None
            fill = statistics.median(r[1] for r in runs) / 1e6 if runs else None
            rows.append({"size_bytes": size, "allocator": name, "first_ms": first, "fill_ms": fill})
            print(f"[torch_pinned_cold] {name} {fmt_size(size)}: {first} ms", file=sys.stderr)
    print(f"## PyTorch cold pinned growth (torch {version}), median of {a.reps} processes\n")
    print("| size | allocator | first allocation | then filling it |")
    print("|---|---|---|---|")
    ms = lambda x: "-" if x is None else f"{x:.2f} ms"
    for r in rows:
        print(f"| {fmt_size(r['size_bytes'])} | {r['allocator']} | {ms(r['first_ms'])} | {ms(r['fill_ms'])} |")
    for f in failures:
        print(f"\nfailed: {f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": version, "reps": a.reps, "rows": rows, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
