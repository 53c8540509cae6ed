#!/usr/bin/env python3
"""Replays a trace on the device's default driver pool (cudaMallocAsync / cudaFreeAsync
through CuPy, release threshold at its maximum) and logs the pool's reserved and used
bytes after every operation, so that its growth rule and the free memory it holds at each
growth can be read off (BENCHMARKS.md, 2026-12-06 fourth session; the simulated driver
pool of `src/device/fake/pool_model.rs` is checked against it).

    python3 tools/driver_pool_growth.py TRACE.csv|SNAPSHOT.pickle OUT.txt

TRACE is read as `tools/peers_replay.py` reads it (RMM's CSV log or a PyTorch snapshot),
each recorded stream on a non-blocking stream of its own, frees on their allocation's
stream. OUT gets a summary line, then one line per operation:
`a INDEX SIZE RESERVED USED REQUESTED GREW FREE_BEFORE PTR` for an allocation (GREW: bytes
the pool grew by for it; FREE_BEFORE: reserved - used before it) and
`f INDEX SIZE RESERVED USED REQUESTED` for a free. The summary is also printed. Needs a
GPU and CuPy.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers_replay  # noqa: E402

RELEASE_THRESHOLD, RESERVED, RESERVED_HIGH, USED = 4, 5, 6, 7  # cudaMemPoolAttr*


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    import cupy

    path, out = sys.argv[1], sys.argv[2]
    plan = peers_replay.load(path, True)
    rt = cupy.cuda.runtime
    cupy.cuda.Device(0).use()
    pool = rt.deviceGetDefaultMemPool(0)
    rt.memPoolSetAttribute(pool, RELEASE_THRESHOLD, (1 << 64) - 1)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(max(plan.streams, 1))]
    # A first allocation sets stream-ordered allocation up; then nothing is reserved.
    p = rt.mallocAsync(512, streams[0].ptr)
    rt.freeAsync(p, streams[0].ptr)
    rt.deviceSynchronize()
    rt.memPoolTrimTo(pool, 0)
    rt.memPoolSetAttribute(pool, RESERVED_HIGH, 0)

    def reserved():
        return rt.memPoolGetAttribute(pool, RESERVED)

    def used():
        return rt.memPoolGetAttribute(pool, USED)

    t = time.perf_counter_ns()
    for _ in range(10000):
        reserved()
    query_ns = (time.perf_counter_ns() - t) / 10000
    blocks = [None] * plan.slots
    lines = []
    requested = peak_requested = growths = most_free_at_growth = 0
    for i, (free, slot, size, s) in enumerate(plan.ops):
        stream = streams[s].ptr
        if free:
            b = blocks[slot]
            if b is None:
                continue
            rt.freeAsync(b, stream)
            blocks[slot] = None
            requested -= size
            lines.append(f"f {i} {size} {reserved()} {used()} {requested}")
            continue
        r0, u0 = reserved(), used()
        try:
            b = rt.mallocAsync(size, stream)
        except Exception as e:  # out of memory: logged, the replay goes on
            lines.append(f"x {i} {size} {e}")
            continue
        blocks[slot] = b
        requested += size
        peak_requested = max(peak_requested, requested)
        r1, u1 = reserved(), used()
        if r1 > r0:
            growths += 1
            most_free_at_growth = max(most_free_at_growth, r0 - u0)
        lines.append(f"a {i} {size} {r1} {u1} {requested} {r1 - r0} {r0 - u0} {b:#x}")
    rt.deviceSynchronize()
    peak_reserved = rt.memPoolGetAttribute(pool, RESERVED_HIGH)
    for b in blocks:
        if b is not None:
            rt.freeAsync(b, streams[0].ptr)
    rt.deviceSynchronize()
    mib = 1 << 20
    summary = (
        f"{path}: peak requested {peak_requested / mib:.1f} MiB, peak reserved "
        f"{peak_reserved / mib:.1f} MiB, {growths} growths, most free at a growth "
        f"{most_free_at_growth / mib:.1f} MiB, attribute query {query_ns:.0f} ns"
    )
    with open(out, "w") as f:
        f.write(f"# {summary}\n")
        f.write("# a INDEX SIZE RESERVED USED REQUESTED GREW FREE_BEFORE PTR | f INDEX SIZE RESERVED USED REQUESTED\n")
        f.write("\n".join(lines) + "\n")
    print(summary)


if __name__ == "__main__":
    main()
