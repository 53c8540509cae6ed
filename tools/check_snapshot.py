#!/usr/bin/env python3
"""Checks a memory snapshot pickle (PyTorch's `torch.cuda.memory._snapshot()` layout, as
cudalloc's `trace::format::torch` writes it) using only the standard library, and prints
its counts.

    python3 tools/check_snapshot.py FILE

The unpickler refuses every global (no class, function or module is ever loaded), so a
hostile file cannot run code. Exit status: 0 when the structure is right, 1 (with the
reason on stderr) when it is not.
"""

import io
import pickle
import sys
from collections import Counter

ACTIONS = {
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
}
STATES = {"active_allocated", "active_pending_free", "inactive"}


class NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} refused: a snapshot is plain data")


class Bad(Exception):
    pass


def need(cond, msg):
    if not cond:
        raise Bad(msg)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check_frames(frames, where):
    need(isinstance(frames, list), f"{where}.frames: not a list")
    for i, f in enumerate(frames):
        w = f"{where}.frames[{i}]"
        need(isinstance(f, dict), f"{w}: not a dict")
        need(isinstance(f.get("filename"), str), f"{w}.filename: not a str")
        need(isinstance(f.get("name"), str), f"{w}.name: not a str")
        need(is_int(f.get("line")), f"{w}.line: not an int")


def check(snap):
    need(isinstance(snap, dict), "the snapshot is not a dict")
    for key in ("segments", "device_traces"):
        need(key in snap, f"no `{key}`")
    segments, traces = snap["segments"], snap["device_traces"]
    need(isinstance(segments, list), "segments: not a list")
    need(isinstance(traces, list), "device_traces: not a list")
    counts = Counter()
    reserved = allocated = requested = 0
    for i, seg in enumerate(segments):
        w = f"segments[{i}]"
        need(isinstance(seg, dict), f"{w}: not a dict")
        for key in ("device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream"):
            need(is_int(seg.get(key)), f"{w}.{key}: not an int")
        need(seg.get("segment_type") in ("large", "small"), f"{w}.segment_type: not 'large' or 'small'")
        need(isinstance(seg.get("is_expandable"), bool), f"{w}.is_expandable: not a bool")
        need(isinstance(seg.get("segment_pool_id"), (list, tuple)), f"{w}.segment_pool_id: not a list")
        check_frames(seg.get("frames"), w)
        blocks = seg.get("blocks")
        need(isinstance(blocks, list), f"{w}.blocks: not a list")
        at, active = seg["address"], 0
        for j, b in enumerate(blocks):
            bw = f"{w}.blocks[{j}]"
            need(isinstance(b, dict), f"{bw}: not a dict")
            for key in ("address", "size", "requested_size"):
                need(is_int(b.get(key)), f"{bw}.{key}: not an int")
            need(b.get("state") in STATES, f"{bw}.state: {b.get('state')!r}")
            check_frames(b.get("frames"), bw)
            need(b["address"] == at, f"{bw}: at {b['address']:#x}, the previous block ends at {at:#x}")
            need(b["requested_size"] <= b["size"], f"{bw}: requested_size above size")
            at += b["size"]
            if b["state"] == "active_allocated":
                active += b["size"]
                requested += b["requested_size"]
            counts["blocks " + b["state"]] += 1
        need(at == seg["address"] + seg["total_size"], f"{w}: its blocks do not fill total_size")
        need(active == seg["allocated_size"], f"{w}: allocated_size is not its active blocks' sizes")
        reserved += seg["total_size"]
        allocated += active
    entries = 0
    for d, entries_d in enumerate(traces):
        need(isinstance(entries_d, list), f"device_traces[{d}]: not a list")
        for i, e in enumerate(entries_d):
            w = f"device_traces[{d}][{i}]"
            need(isinstance(e, dict), f"{w}: not a dict")
            need(e.get("action") in ACTIONS, f"{w}.action: {e.get('action')!r}")
            for key in ("addr", "size", "stream", "time_us"):
                need(is_int(e.get(key)), f"{w}.{key}: not an int")
            if e["action"] == "oom":
                need(is_int(e.get("device_free")), f"{w}.device_free: not an int")
            check_frames(e.get("frames"), w)
            counts[e["action"]] += 1
            entries += 1
    return {
        "segments": len(segments),
        "total_reserved": reserved,
        "total_allocated": allocated,
        "total_requested": requested,
        "devices": len(traces),
        "entries": entries,
        **dict(sorted(counts.items())),
    }


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        with open(argv[1], "rb") as f:
            snap = NoGlobals(io.BytesIO(f.read())).load()
        summary = check(snap)
    except (Bad, pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, OSError) as e:
        print(f"check_snapshot: {argv[1]}: {e}", file=sys.stderr)
        return 1
    for k, v in summary.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
