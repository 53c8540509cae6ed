#!/usr/bin/env python3
"""placement_floor.py: what a page heap's placement policies reserve on a PyTorch snapshot,
in a model kinder than the real heap.

Issue 23 asks the default device pool to reserve no more than the driver's own pool on
every replayed trace. On the cs336 forward pass the pool reserves 9840 MiB where the
driver pool reserves 9792 MiB (BENCHMARKS.md). This script asks whether any placement
policy of a page heap could close that gap. It models a heap better than the real one:

- every block, small ones included, lives in one virtual range (the real pool keeps
  blocks under 2 MiB in a driver-pool step of its own);
- a 2 MiB granule is mapped while any live block overlaps it and unmapped the moment
  none does (no chunks, no idle allowance, no cost for mapping);
- blocks are rounded to UNIT bytes (default 512; the real heap uses 64 KiB runs).

For each of six placement policies (first fit, best fit, fewest new granules with four
tie-breaks) it replays the allocations and frees in order and prints the peak of mapped
granules. Each policy tries the start and the end of every free gap that fits, and the
granule-aligned places inside it. The lowest figure is the best these policies reach in
a model kinder than the real heap; it is not a proven optimum (an offline packing that
knows the future could do better). Where the driver reserves less than that, the gap is
not a matter of picking one of these policies.

    python3 tools/placement_floor.py TRACE.pickle [UNIT] [--apart]

With --apart, blocks under 2 MiB are left out, as the real pool keeps them apart (in a
driver-pool step of their own); the figures are then the large blocks' alone.

Only PyTorch snapshots (`torch.cuda.memory._dump_snapshot`) are read, one device and
all streams together; frees are taken at `free_completed`. Pure Python, no GPU.
"""
import bisect
import pickle
import sys
from collections import Counter

MIB = 1 << 20
GRANULE = 2 * MIB
INF = 1 << 62


def events(path, least):
    """The (kind, address, size) of every allocation and completed free of at least
    `least` bytes, in order."""
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    out = []
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["size"] < least:
                continue
            if e["action"] == "alloc":
                out.append(("a", e["addr"], e["size"]))
            elif e["action"] == "free_completed":
                out.append(("f", e["addr"], e["size"]))
    return out


def candidates(starts, ends, n):
    """Every place a block of n bytes could go: each gap's start and end, the
    granule-aligned places inside it, and the end of the range."""
    prev = 0
    for s in starts:
        gap = s - prev
        if gap >= n:
            yield gap, prev
            yield gap, s - n
            aligned = -(-prev // GRANULE) * GRANULE
            if aligned + n <= s:
                yield gap, aligned
            last = s // GRANULE * GRANULE - n
            if last >= prev:
                yield gap, last
        prev = max(prev, ends[s])
    yield None, prev


def replay(evs, policy, unit):
    """Peak mapped bytes and peak requested bytes under one placement policy."""
    starts, ends, where = [], {}, {}
    users = Counter()
    mapped = peak = requested = peak_requested = 0
    for kind, addr, size in evs:
        if kind == "a":
            n = max(unit, -(-size // unit) * unit)
            best = None
            for gap, s in candidates(starts, ends, n):
                granules = range(s // GRANULE, (s + n - 1) // GRANULE + 1)
                new = sum(1 for g in granules if users[g] == 0)
                key = policy(s, n, gap, new)
                if best is None or key < best[0]:
                    best = (key, s)
            s = best[1]
            bisect.insort(starts, s)
            ends[s] = s + n
            where[addr] = s
            for g in range(s // GRANULE, (s + n - 1) // GRANULE + 1):
                mapped += users[g] == 0
                users[g] += 1
            requested += size
            peak_requested = max(peak_requested, requested)
            peak = max(peak, mapped)
        elif addr in where:
            s = where.pop(addr)
            end = ends.pop(s)
            starts.remove(s)
            for g in range(s // GRANULE, (end - 1) // GRANULE + 1):
                users[g] -= 1
                mapped -= users[g] == 0
            requested -= size
    return peak * GRANULE, peak_requested


POLICIES = {
    "first fit": lambda s, n, gap, new: (s,),
    "best fit": lambda s, n, gap, new: (INF if gap is None else gap, s),
    "fewest new granules, then lowest": lambda s, n, gap, new: (new, s),
    "fewest new granules, then best fit": lambda s, n, gap, new: (new, INF if gap is None else gap, s),
    "fewest new granules, exact fits first": lambda s, n, gap, new: (new, gap != n, s),
    "fewest new granules, then highest": lambda s, n, gap, new: (new, -s),
}


def main():
    args = [a for a in sys.argv[1:] if a != "--apart"]
    apart = len(args) < len(sys.argv) - 1
    if not args:
        sys.exit(__doc__)
    unit = int(args[1]) if len(args) > 1 else 512
    evs = events(args[0], GRANULE if apart else 0)
    which = "allocations of 2 MiB or more" if apart else "allocations"
    print(f"{args[0]}: {sum(k == 'a' for k, _, _ in evs)} {which}, {unit} B units")
    floor = None
    for name, policy in POLICIES.items():
        peak, requested = replay(evs, policy, unit)
        floor = peak if floor is None else min(floor, peak)
        print(f"  {name:42} peak mapped {peak / MIB:9.0f} MiB  (peak requested {requested / MIB:.1f} MiB)")
    print(f"  lowest of the six: {floor / MIB:.0f} MiB")


if __name__ == "__main__":
    main()
