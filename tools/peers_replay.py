#!/usr/bin/env python3
"""Replays an RMM-format CSV trace or a PyTorch memory snapshot against PyTorch's and CuPy's
allocators (issue 23's peers), with the columns of `examples/replay.rs`, so their figures sit
next to cudalloc's.

    python3 tools/peers_replay.py TRACE.csv|SNAPSHOT.pickle [--allocators torch,torch-expandable,cupy,cupy-async]
                                            [--json OUT] [--lenient] [--device N] [--torch-public]
    python3 tools/peers_replay.py --self-test

TRACE is RMM's log (`Thread,Time,Action,Pointer,Size,Stream`, what the crate's `rmm::write`
and `CUDALLOC_TRACE=run.csv` write), read and checked as the crate reads it: the same errors
for the same bad lines and events, `--lenient` to skip them. A PyTorch snapshot (a pickle) is
read with the standard library's unpickler, every global refused: its `device_traces`, `alloc`
and `free_requested` entries as the crate's replay takes them (`read_snapshot`).

The allocators, each in a fresh process of its own (this script run again with --child), so
that each starts with an empty GPU and PYTORCH_CUDA_ALLOC_CONF applies before CUDA starts:
  empty             the replay loop with no allocator (its bookkeeping and clock reads):
                    always run, to subtract from the others
  torch             PyTorch's caching allocator (PYTORCH_CUDA_ALLOC_CONF unset)
  torch-expandable  the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  cupy              cupy.cuda.MemoryPool
  cupy-async        cupy.cuda.MemoryAsyncPool (cudaMallocAsync on the device's default pool)
  fake              a size-class pool in Python (tools/peers_fakes/fakepool.py), for tests

Replay: the events in their recorded global order, each recorded stream on a real stream
of its own (torch.cuda.Stream / cupy.cuda.Stream, non-blocking), frees on the stream of
their allocation, on ONE Python thread for all recorded threads (the crate replays each
recorded thread on a thread of its own, in the same global order). Each allocation and
free is timed with time.perf_counter_ns; the total is the whole replay with one device
synchronize at its end; the interpreter's garbage collector is off during the replay.
Allocations that fail are counted (the replay goes on and skips their frees); blocks the
trace never frees are reported, then freed after the timed run.

Peak reserved: torch `memory_stats()["reserved_bytes.all.peak"]` (after a warm-up
allocation, `empty_cache()` and `reset_peak_memory_stats()`); cupy `pool.total_bytes()`
after each allocation (an O(1) read, inside the timed run); cupy-async the driver pool's
`cudaMemPoolAttrReservedMemHigh` (reset after a warm-up and a trim). Torch is called
through the binding its public `caching_allocator_alloc` / `caching_allocator_delete` wrap
(`torch._C._cuda_cudaCachingAllocator_raw_alloc` / `_raw_delete`), which skips a device
switch per call; --torch-public uses the public functions.
"""

import argparse
import gc
import io
import json
import math
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # no __pycache__ next to the stand-ins in tools/peers_fakes

HEADER = "Thread,Time,Action,Pointer,Size,Stream"
MAX_BLOCK_BYTES = 1 << 47  # ReplayOptions::default().max_block_bytes
PEERS = ["torch", "torch-expandable", "cupy", "cupy-async"]
KNOWN = ["empty"] + PEERS + ["fake"]
FAKES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers_fakes")
NAMES = {
    "empty": "Python loop, no allocator",
    "torch": "PyTorch caching",
    "torch-expandable": "PyTorch expandable segments",
    "cupy": "CuPy MemoryPool",
    "cupy-async": "CuPy MemoryAsyncPool",
    "fake": "fake size-class pool (Python)",
}
COLUMNS = [  # the replay table of examples/common/replay_report.rs: key, title, unit
    ("allocator", "allocator", "label"),
    ("total_ms", "total", "ms"),
    ("alloc_median_ns", "alloc median", "ns"),
    ("alloc_p99_ns", "alloc p99", "ns"),
    ("free_median_ns", "free median", "ns"),
    ("free_p99_ns", "free p99", "ns"),
    ("peak_requested", "peak requested", "B"),
    ("peak_reserved", "peak reserved", "B"),
    ("reserved_ratio", "reserved / requested", "x"),
    ("failures", "failed allocs", "count"),
    ("never_freed", "never freed", "count"),
]


class TraceError(Exception):
    """A bad line or event, worded as the crate's `TraceError` (`line N: ...`, `event N: ...`)."""


# ---------------------------------------------------------------------------------------
# Reading: src/trace/format/rmm.rs, line for line


def parse_hex(s):
    if s == "(nil)":
        return 0
    digits = s[2:] if s[:2] in ("0x", "0X") else s
    if not digits or not all(c in "0123456789abcdefABCDEF" for c in digits):
        return None
    v = int(digits, 16)
    return v if v < 1 << 64 else None


def parse_dec(s):
    if not s or not (s.isascii() and s.isdigit()):
        return None
    v = int(s)
    return v if v < 1 << 64 else None


def parse_time(s):
    """`HH:MM:SS.ffffff` (fraction of 1 to 9 digits): nanoseconds since midnight."""
    hms, _, frac = s.partition(".") if "." in s else (s, "", "0")
    parts = hms.split(":")
    if len(parts) != 3 or not frac or len(frac) > 9:
        return None

    def num(x, top):
        v = parse_dec(x)
        return v if v is not None and v < top else None

    h, m, sec, f = num(parts[0], 24), num(parts[1], 60), num(parts[2], 61), num(frac, 10**9)
    if None in (h, m, sec, f):
        return None
    return ((h * 60 + m) * 60 + sec) * 10**9 + f * 10 ** (9 - len(frac))


def parse_row(line):
    f = [x.strip() for x in line.split(",")]
    if len(f) != 6:
        raise ValueError(
            f"expected 6 fields (Thread,Time,Action,Pointer,Size,Stream), found {len(f)}: `{line}`"
        )
    thread = parse_dec(f[0])
    if thread is None:
        raise ValueError(f"thread `{f[0]}` is not a decimal number")
    if parse_time(f[1]) is None:
        raise ValueError(f"time `{f[1]}` is not HH:MM:SS.ffffff")
    action = {"allocate": "alloc", "free": "free", "allocate failure": "failure"}.get(f[2])
    if action is None:
        raise ValueError(f"action `{f[2]}` is not `allocate`, `free` or `allocate failure`")
    addr = parse_hex(f[3])
    if addr is None:
        raise ValueError(f"pointer `{f[3]}` is not hex (`0x...`) or `(nil)`")
    if addr == 0 and action != "failure":
        raise ValueError(f"`{f[2]}` with a null pointer")
    size = parse_dec(f[4])
    if size is None:
        raise ValueError(f"size `{f[4]}` is not a decimal number")
    stream = parse_hex(f[5])
    if stream is None:
        raise ValueError(f"stream `{f[5]}` is not hex (`0x...`) or `(nil)`")
    return thread, action, addr, size, stream


def read_rmm(text, lenient=False):
    """The events (thread, action, addr, size, stream) and the skipped lines' errors."""
    lines = [l[:-1] if l.endswith("\r") else l for l in text.split("\n")]
    if lines and lines[-1] == "":
        lines.pop()
    i = 0
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i == len(lines):
        raise TraceError("input: empty input: no RMM log header")
    if lines[i].strip().replace(" ", "") != HEADER:
        raise TraceError(f"line {i + 1}: not an RMM log: the header is not `{HEADER}`")
    events, skipped = [], []
    for n in range(i + 1, len(lines)):
        line = lines[n].strip()
        if not line:
            continue
        try:
            events.append(parse_row(line))
        except ValueError as e:
            if not lenient:
                raise TraceError(f"line {n + 1}: {e}") from None
            skipped.append(f"line {n + 1}: {e}")
    return events, skipped


# ---------------------------------------------------------------------------------------
# The plan: src/trace/replay/mod.rs `Plan::new`, with its checks and messages


class Plan:
    def __init__(self, events, lenient=False):
        self.ops = []  # (free, slot, size, stream index)
        self.slots = 0
        self.skipped = []
        self.recorded_failures = 0
        live = {}  # addr -> (slot, size, event)
        freed = {}  # addr -> the event that last freed a block there
        streams, threads = {}, {}
        for i, (thread, action, addr, size, stream) in enumerate(events):
            if action == "alloc":
                if size > MAX_BLOCK_BYTES:
                    bad = (
                        f"allocation of {size} bytes, beyond memory "
                        f"(at most {MAX_BLOCK_BYTES} bytes a block)"
                    )
                elif addr in live:
                    bad = (
                        f"allocation at {addr:#x}, which event {live[addr][2]} allocated "
                        "and the trace has not freed"
                    )
                else:
                    bad = None
                if bad:
                    self._reject(f"event {i}: {bad}", lenient)
                    continue
                op = (False, self.slots, size)
                live[addr] = (self.slots, size, i)
                freed.pop(addr, None)
                self.slots += 1
            elif action == "free":
                if addr not in live:
                    if addr in freed:
                        msg = f"double free of {addr:#x} (event {freed[addr]} freed it)"
                    else:
                        msg = f"free of {addr:#x}, which the trace never allocated"
                    self._reject(f"event {i}: {msg}", lenient)
                    continue
                slot, size, _ = live.pop(addr)
                freed[addr] = i
                op = (True, slot, size)
            else:
                self.recorded_failures += 1
                continue
            s = streams.setdefault(stream, len(streams))
            threads.setdefault(thread, len(threads))
            self.ops.append(op + (s,))
        self.streams = len(streams)
        self.threads = len(threads)
        self.never_freed = sorted((slot, size) for slot, size, _ in live.values())

    def _reject(self, msg, lenient):
        if not lenient:
            raise TraceError(msg)
        self.skipped.append(msg)

    def allocations(self):
        return sum(1 for op in self.ops if not op[0])

    def peak_requested(self):
        now = peak = 0
        for free, _, size, _ in self.ops:
            now = now - size if free else now + size
            peak = max(peak, now)
        return peak


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} refused: a snapshot is plain data")


def read_snapshot(data):
    """The events of a PyTorch memory snapshot (`device_traces`), as the crate's
    `trace::format::torch::read` takes them for a replay: `alloc` allocates, `free_requested`
    frees (what the program did; `free_completed` is the allocator's own later step),
    `oom` is a recorded failure, everything else (segments, snapshots) is skipped. Every
    device's list in order, each entry on thread 0 (PyTorch records no thread)."""
    try:
        top = _NoGlobals(io.BytesIO(data)).load()
    except Exception as e:  # a malformed pickle is the input's error, whatever it is
        raise TraceError(f"input: bad pickle: {e}") from None
    traces = top.get("device_traces") if isinstance(top, dict) else None
    if not isinstance(traces, list):
        raise TraceError("input: snapshot has no `device_traces` list")
    events = []
    for d, entries in enumerate(traces):
        for i, e in enumerate(entries if isinstance(entries, list) else []):
            if not isinstance(e, dict):
                raise TraceError(f"input: device_traces[{d}][{i}]: expected a dict")
            action = {"alloc": "alloc", "free_requested": "free", "oom": "failure"}.get(e.get("action"))
            if action is None:
                continue
            addr, size = int(e.get("addr", 0) or 0), int(e.get("size", 0) or 0)
            events.append((0, action, addr, size, (d, int(e.get("stream", 0) or 0))))
    return events, []


def load(path, lenient):
    with open(path, "rb") as f:
        data = f.read()
    if data[:1] == b"\x80":
        events, skipped = read_snapshot(data)
        plan = Plan(events, lenient)
        plan.skipped = skipped + plan.skipped
        plan.events = len(events)
        return plan
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(f"input: not UTF-8 text ({e})") from None
    events, skipped = read_rmm(text, lenient)
    plan = Plan(events, lenient)
    plan.skipped = skipped + plan.skipped
    plan.events = len(events)
    return plan


# ---------------------------------------------------------------------------------------
# The replay loops, one per calling convention so that no wrapper call is timed. Each
# returns (total_ns, alloc times, free times, peak requested, failures, first failure,
# blocks, peak of track()).


def replay_empty(plan, sync):
    """The loop's own work: clock reads, the block list, the request count."""
    ops, pc = plan.ops, time.perf_counter_ns
    blocks = [None] * plan.slots
    at, ft = [], []
    req = peak = 0
    start = pc()
    for free, slot, size, s in ops:
        if free:
            p = blocks[slot]
            if p is None:
                continue
            blocks[slot] = None
            t0 = pc()
            t1 = pc()
            ft.append(t1 - t0)
            req -= size
        else:
            t0 = pc()
            p = slot + 1
            t1 = pc()
            at.append(t1 - t0)
            blocks[slot] = p
            req += size
            if req > peak:
                peak = req
    sync()
    total = pc() - start
    return total, at, ft, peak, 0, None, blocks, None


def replay_torch(plan, alloc, delete, handles, sync):
    """`alloc(size, stream handle) -> int pointer`, `delete(pointer)`."""
    ops, pc = plan.ops, time.perf_counter_ns
    blocks = [None] * plan.slots
    at, ft = [], []
    req = peak = fails = 0
    first = None
    start = pc()
    for free, slot, size, s in ops:
        if free:
            p = blocks[slot]
            if p is None:
                continue
            blocks[slot] = None
            t0 = pc()
            if p:
                delete(p)
            t1 = pc()
            ft.append(t1 - t0)
            req -= size
        else:
            t0 = pc()
            try:
                p = alloc(size, handles[s])
            except Exception as e:  # OutOfMemoryError, or what the allocator raised
                fails += 1
                if first is None:
                    first = f"{size} bytes: {type(e).__name__}: {e}"
                continue
            t1 = pc()
            at.append(t1 - t0)
            blocks[slot] = p
            req += size
            if req > peak:
                peak = req
    sync()
    total = pc() - start
    return total, at, ft, peak, fails, first, blocks, None


def replay_cupy(plan, malloc, streams, track, sync):
    """`malloc(size) -> MemoryPointer` on the current stream (`streams[s].use()`); a free is
    the drop of the last reference; `track()` (or None) read after each allocation."""
    ops, pc = plan.ops, time.perf_counter_ns
    blocks = [None] * plan.slots
    at, ft = [], []
    req = peak = fails = 0
    tracked = 0
    first = None
    cur = -1
    b = None
    start = pc()
    for free, slot, size, s in ops:
        if free:
            b = blocks[slot]
            if b is None:
                continue
            blocks[slot] = None
            t0 = pc()
            b = None  # the last reference: the block goes back to its pool and stream
            t1 = pc()
            ft.append(t1 - t0)
            req -= size
        else:
            if s != cur:
                streams[s].use()
                cur = s
            t0 = pc()
            try:
                b = malloc(size)
            except Exception as e:  # OutOfMemoryError, or what the allocator raised
                fails += 1
                if first is None:
                    first = f"{size} bytes: {type(e).__name__}: {e}"
                continue
            t1 = pc()
            at.append(t1 - t0)
            blocks[slot] = b
            b = None
            req += size
            if req > peak:
                peak = req
            if track is not None:
                r = track()
                if r > tracked:
                    tracked = r
    sync()
    total = pc() - start
    return total, at, ft, peak, fails, first, blocks, tracked


def percentiles(v):
    """Median and 99th percentile as the crate takes them (nearest rank, half away from 0)."""
    if not v:
        return 0, 0
    v = sorted(v)
    at = lambda q: v[int(math.floor((len(v) - 1) * q + 0.5))]
    return at(0.5), at(0.99)


def result(name, plan, run, peak_reserved, extra):
    total, at, ft, peak, fails, first, blocks, _ = run
    never = [(slot, size) for slot, size in plan.never_freed if blocks[slot] is not None]
    am, ap = percentiles(at)
    fm, fp = percentiles(ft)
    r = {
        "allocator": NAMES[name],
        "total_ms": total / 1e6,
        "alloc_median_ns": am,
        "alloc_p99_ns": ap,
        "free_median_ns": fm,
        "free_p99_ns": fp,
        "peak_requested": peak,
        "peak_reserved": peak_reserved,
        "reserved_ratio": peak_reserved / peak if peak_reserved is not None and peak else None,
        "failures": fails,
        "never_freed": len(never),
        "name": name,
        "allocations": len(at),
        "frees": len(ft),
        "never_freed_bytes": sum(size for _, size in never),
        "first_failure": first,
        "streams": plan.streams,
    }
    r.update(extra)
    return r


# ---------------------------------------------------------------------------------------
# The children: one allocator each, in a fresh process


def child_empty(plan, args):
    gc.disable()
    run = replay_empty(plan, lambda: None)
    gc.enable()
    return result("empty", plan, run, None, {"python": sys.version.split()[0]})


def child_fake(plan, args):
    sys.path.insert(0, FAKES)
    from fakepool import SizeClassPool

    pool = SizeClassPool(int(os.environ.get("PEERS_FAKE_LIMIT", "0")))
    state = {"stream": 0}

    class Ptr:
        __slots__ = ("addr",)

        def __init__(self, size):
            self.addr = pool.alloc(size, state["stream"])

        def __del__(self):
            pool.release(self.addr)

    class FakeStream:
        def __init__(self, i):
            self.i = i

        def use(self):
            state["stream"] = self.i

    streams = [FakeStream(i) for i in range(max(plan.streams, 1))]
    gc.disable()
    run = replay_cupy(plan, Ptr, streams, lambda: pool.reserved, lambda: None)
    gc.enable()
    blocks = run[6]
    r = result("fake", plan, run, run[7], {"fake_peak_reserved": pool.peak_reserved})
    blocks.clear()
    r["fake_live_after"] = len(pool.live)
    return r


def child_torch(plan, args, name):
    import torch

    dev = args.device
    torch.cuda.init()
    torch.cuda.set_device(dev)
    streams = [torch.cuda.Stream(device=dev) for _ in range(max(plan.streams, 1))]
    handles = [s.cuda_stream for s in streams]
    raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
    raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
    if args.torch_public or raw_alloc is None or raw_delete is None:
        api = "torch.cuda.caching_allocator_alloc / caching_allocator_delete"
        public_alloc = torch.cuda.caching_allocator_alloc

        def alloc(size, stream):
            return public_alloc(size, dev, stream)

        delete = torch.cuda.caching_allocator_delete
    else:
        api = "torch._C._cuda_cudaCachingAllocator_raw_alloc / _raw_delete"
        alloc, delete = raw_alloc, raw_delete
    # Warm-up: the allocator's lazy start is not charged; then nothing reserved, peaks reset.
    p = alloc(512, handles[0])
    delete(p)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    sync = lambda: torch.cuda.synchronize(dev)
    gc.disable()
    run = replay_torch(plan, alloc, delete, handles, sync)
    gc.enable()
    stats = torch.cuda.memory_stats(dev)
    segments = torch.cuda.memory_snapshot()
    flags = {s.get("is_expandable") for s in segments if "is_expandable" in s}
    expandable = flags.pop() if len(flags) == 1 else (None if not flags else "mixed")
    r = result(
        name,
        plan,
        run,
        stats.get("reserved_bytes.all.peak"),
        {
            "torch": torch.__version__,
            "cuda": getattr(torch.version, "cuda", None),
            "device": torch.cuda.get_device_name(dev),
            "api": api,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "is_expandable": expandable,
            "allocated_bytes_peak": stats.get("allocated_bytes.all.peak"),
            "num_alloc_retries": stats.get("num_alloc_retries"),
            "num_ooms": stats.get("num_ooms"),
            "segments": len(segments),
        },
    )
    for p in run[6]:
        if p:
            delete(p)
    torch.cuda.synchronize(dev)
    return r


def child_cupy(plan, args, name):
    import warnings

    import cupy

    warnings.simplefilter("ignore", FutureWarning)  # MemoryAsyncPool is "experimental"
    dev = args.device
    cupy.cuda.Device(dev).use()
    runtime = cupy.cuda.runtime
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(max(plan.streams, 1))]
    extra = {
        "cupy": cupy.__version__,
        "cuda_runtime": runtime.runtimeGetVersion(),
        "cuda_driver": runtime.driverGetVersion(),
        "device": _name(runtime.getDeviceProperties(dev)["name"]),
    }
    if name == "cupy":
        pool = cupy.cuda.MemoryPool()
        track = pool.total_bytes
        extra["peak_reserved_from"] = "max of MemoryPool.total_bytes() after each allocation"
    else:
        pool = cupy.cuda.MemoryAsyncPool()
        track = None
        handle = runtime.deviceGetDefaultMemPool(dev)
        high = getattr(runtime, "cudaMemPoolAttrReservedMemHigh", 6)
        extra["peak_reserved_from"] = "cudaMemPoolAttrReservedMemHigh of the default pool"
    # Warm-up: CuPy's first allocation on a stream is not charged; then nothing reserved.
    streams[0].use()
    b = pool.malloc(512)
    b = None
    runtime.deviceSynchronize()
    pool.free_all_blocks()
    cupy.cuda.Stream.null.use()
    if track is None:
        try:
            runtime.memPoolSetAttribute(handle, high, 0)
        except Exception as e:
            track = pool.total_bytes
            extra["peak_reserved_from"] = f"max of total_bytes() after each allocation ({e})"
    sync = runtime.deviceSynchronize
    gc.disable()
    run = replay_cupy(plan, pool.malloc, streams, track, sync)
    gc.enable()
    cupy.cuda.Stream.null.use()
    peak = run[7] if track is not None else runtime.memPoolGetAttribute(handle, high)
    if track is not None:
        # What those reads cost the total, for the reader to take off.
        t = time.perf_counter_ns()
        for _ in range(10000):
            track()
        per_read = (time.perf_counter_ns() - t) / 10000
        extra["track_ns_per_read"] = per_read
        extra["track_ms_in_total"] = per_read * len(run[1]) / 1e6
    r = result(name, plan, run, peak, extra)
    run[6].clear()
    runtime.deviceSynchronize()
    return r


def _name(n):
    return n.decode() if isinstance(n, bytes) else str(n)


def child_main(args):
    plan = load(args.trace, args.lenient)
    if args.child == "empty":
        r = child_empty(plan, args)
    elif args.child == "fake":
        r = child_fake(plan, args)
    elif args.child.startswith("torch"):
        r = child_torch(plan, args, args.child)
    else:
        r = child_cupy(plan, args, args.child)
    sys.stdout.write("peers-result " + json.dumps(r) + "\n")
    sys.stdout.flush()
    return 0


def child_env(name, extra_path=None):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    # Each peer as a user who sets nothing gets it: no inherited allocator settings
    # (PYTORCH_ALLOC_CONF is the newer name PyTorch also reads; the caching switch-off;
    # CuPy's limit, which MemoryAsyncPool turns into the pool's release threshold).
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING", "CUPY_GPU_MEMORY_LIMIT"):
        env.pop(var, None)
    if name == "torch-expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path, env.get("PYTHONPATH")]))
    return env


def run_child(name, args, extra_path=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, args.trace]
    cmd += ["--device", str(args.device)]
    if args.lenient:
        cmd.append("--lenient")
    if args.torch_public:
        cmd.append("--torch-public")
    out = subprocess.run(cmd, env=child_env(name, extra_path), capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("peers-result "):
            return json.loads(line[len("peers-result ") :])
    tail = (out.stderr.strip() or out.stdout.strip())[-1500:]
    raise RuntimeError(f"exit {out.returncode}: {tail}")


# ---------------------------------------------------------------------------------------
# The report: the crate's units and its Markdown


def fmt_size(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def fmt_time_ns(ns):
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.1f} us"
    return f"{ns / 1e6:.2f} ms"


def cell(v, unit):
    if v is None:
        return "-"
    if unit == "B":
        return fmt_size(int(v))
    if unit == "ns":
        return fmt_time_ns(v)
    if unit == "ms":
        return f"{v:.2f} ms" if v < 10 else f"{v:.1f} ms"
    if unit == "x":
        return f"{v:.2f}x"
    return str(v)


def markdown(title, environment, rows, notes):
    out = [f"# {title}", ""]
    out += [f"- {k}: {v}" for k, v in environment]
    out += ["", "## Replay: time and memory per allocator", ""]
    grid = [[t for _, t, _ in COLUMNS]] + [[cell(r.get(k), u) for k, _, u in COLUMNS] for r in rows]
    w = [max(len(row[i]) for row in grid) for i in range(len(COLUMNS))]
    line = lambda cells: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(cells)) + " |"
    out.append(line(grid[0]))
    out.append("|" + "|".join("-" * (x + 2) for x in w) + "|")
    out += [line(r) for r in grid[1:]]
    if notes:
        out.append("")
        out += [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def row_notes(r):
    n = []
    name = r["allocator"]
    if r.get("first_failure"):
        n.append(f"{name}: {r['failures']} allocations failed, the first of {r['first_failure']}")
    if r["name"].startswith("torch"):
        n.append(
            f"{name}: PYTORCH_CUDA_ALLOC_CONF={r.get('alloc_conf') or '(unset)'}, segments "
            f"expandable: {r.get('is_expandable')}, {r.get('segments')} segments at the end, "
            f"allocated peak {fmt_size(r.get('allocated_bytes_peak') or 0)}, "
            f"{r.get('num_alloc_retries')} alloc retries, via {r.get('api')}"
        )
        want = r["name"] == "torch-expandable"
        if r.get("is_expandable") not in (None, want):
            n.append(f"{name}: WARNING: expandable segments {'not ' if want else ''}in effect")
    if r["name"].startswith("cupy"):
        line = f"{name}: peak reserved from {r.get('peak_reserved_from')}"
        if r.get("track_ms_in_total") is not None:
            line += (
                f" (about {r['track_ns_per_read']:.0f} ns a read, so {r['track_ms_in_total']:.2f} ms "
                "of the total)"
            )
        n.append(line)
    return n


def main_replay(args):
    chosen = [a.strip() for a in args.allocators.split(",") if a.strip()]
    unknown = [a for a in chosen if a not in KNOWN]
    if unknown or not chosen:
        known = ",".join(KNOWN)
        print(f"peers_replay: unknown allocator {','.join(unknown)}; known: {known}", file=sys.stderr)
        return 2
    if "empty" not in chosen:
        chosen.insert(0, "empty")
    try:
        plan = load(args.trace, args.lenient)
    except (OSError, TraceError) as e:
        print(f"peers_replay: {args.trace}: {e}", file=sys.stderr)
        return 1
    for e in plan.skipped[:5]:
        print(f"peers_replay: {args.trace}: skipped {e}", file=sys.stderr)
    rows, notes, failed, versions = [], [], [], {}
    for name in chosen:
        print(f"peers_replay: {name}", file=sys.stderr)
        try:
            r = run_child(name, args, FAKES if args.fakes else None)
        except RuntimeError as e:
            failed.append(name)
            notes.append(f"{NAMES[name]}: did not run: {e}")
            continue
        rows.append(r)
        notes += row_notes(r)
        for k in ("python", "torch", "cupy", "device", "cuda", "cuda_runtime", "cuda_driver"):
            if r.get(k) is not None:
                versions.setdefault(k, r[k])
    environment = [
        ("tool", "tools/peers_replay.py (one Python thread, each allocator in a fresh process)"),
        ("python", versions.get("python", sys.version.split()[0])),
    ]
    for k in ("torch", "cuda", "cupy", "cuda_runtime", "cuda_driver", "device"):
        if k in versions:
            environment.append((k, str(versions[k])))
    environment.append(
        (
            "trace",
            f"{plan.events} events ({plan.allocations()} allocations), {plan.threads} threads, "
            f"{plan.streams} streams, device memory, peak requested {fmt_size(plan.peak_requested())}",
        )
    )
    if args.fakes:
        notes.insert(0, "--fakes: torch and cupy are the stand-ins of tools/peers_fakes, not PyTorch or CuPy.")
    if plan.skipped:
        notes.insert(0, f"--lenient: {len(plan.skipped)} bad lines or events skipped.")
    if plan.recorded_failures:
        notes.append(f"The trace records {plan.recorded_failures} failed allocations: counted, not replayed.")
    never = next((r for r in rows if r["never_freed"]), None)
    if never:
        notes.append(
            f"The trace never frees {never['never_freed']} blocks ({fmt_size(never['never_freed_bytes'])}): "
            "reported, freed after the timed run, not charged."
        )
    notes.append(
        "Times are from Python, interpreter included: each figure less the empty loop's is the "
        "allocator's (with its binding's call). Each operation is timed with two perf_counter_ns "
        "reads; total is the whole replay with one device synchronize; the garbage collector is off."
    )
    if plan.threads > 1:
        notes.append(
            f"The trace's {plan.threads} recorded threads replay on one Python thread, in their "
            "global order (the crate's replay gives each a thread of its own, in the same order)."
        )
    title = f"Peers replay of {args.trace}"
    sys.stdout.write(markdown(title, environment, rows, notes))
    if args.json:
        doc = {
            "title": title,
            "environment": dict(environment),
            "notes": [],
            "tables": [
                {
                    "id": "replay",
                    "section": "replay",
                    "title": "Replay: time and memory per allocator",
                    "columns": [{"key": k, "title": t, "unit": u} for k, t, u in COLUMNS],
                    "notes": notes,
                    "rows": rows,
                }
            ],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"peers_replay: wrote {args.json}", file=sys.stderr)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------
# --self-test: no torch, cupy or GPU needed


SMALL = """Thread,Time,Action,Pointer,Size,Stream
7,10:00:00.000001,allocate,0x1000,1000,0x0
7,10:00:00.000002,allocate,0x2000,3000,0x5a
9,10:00:00.000003,allocate failure,(nil),1099511627776,0x5a
7,10:00:00.000004,free,0x1000,1000,0x0
9,10:00:00.000005,allocate,0x3000,600,0x5a
9,10:00:00.000006,allocate,0x1000,5000,0x0
7,10:00:00.000007,free,0x2000,3000,0x5a
9,10:00:00.000008,free,0x1000,5000,0x0
"""


def random_csv(seed, n, streams=4, max_size=1 << 20):
    """An RMM log of n allocations on `streams` streams and 2 threads, frees at random."""
    rng = random.Random(seed)
    rows, live, addr = [HEADER], [], 1 << 32
    t = 0

    def row(action, a, size, s):
        nonlocal t
        t += 1
        time_of_day = f"00:00:{t // 10**6 % 60:02d}.{t % 10**6:06d}"
        rows.append(f"{rng.choice((11, 12))},{time_of_day},{action},{a:#x},{size},{s:#x}")

    for _ in range(n):
        while live and rng.random() < 0.45:
            a, size, s = live.pop(rng.randrange(len(live)))
            row("free", a, size, s)
        size, s = rng.randrange(1, max_size), rng.randrange(streams) * 0x10
        row("allocate", addr, size, s)
        live.append((addr, size, s))
        addr += size + 256
    for a, size, s in live[: len(live) // 2]:  # the other half is never freed
        row("free", a, size, s)
    return "\n".join(rows) + "\n", len(live) - len(live) // 2


def expected_from_rows(text):
    """Counts, the peak request and the size-class pool's peak reserved, from the rows
    alone (no Plan): the checks the replay's figures must meet."""
    from fakepool import size_class

    now = peak = allocs = frees = 0
    live, per, most = {}, {}, {}
    for line in text.strip().split("\n")[1:]:
        _, _, action, a, size, s = line.split(",")
        size = int(size)
        if action == "allocate":
            allocs += 1
            live[a] = (size, s)
            now += size
            peak = max(peak, now)
            k = (s, size_class(size))
            per[k] = per.get(k, 0) + 1
            most[k] = max(most.get(k, 0), per[k])
        elif action == "free":
            frees += 1
            size, s = live.pop(a)
            now -= size
            per[(s, size_class(size))] -= 1
    reserved = sum(n * cls for (_, cls), n in most.items())
    return {"allocations": allocs, "frees": frees, "peak": peak, "reserved": reserved, "never": len(live)}


def self_test():
    real_cupy = _has("cupy")  # before the stand-ins are on the path
    sys.path.insert(0, FAKES)
    checks = []

    def check(what, got, want):
        ok = got == want
        checks.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {got!r}" + ("" if ok else f", expected {want!r}"))

    def raises(what, text, want):
        try:
            Plan(read_rmm(text)[0])
            got = "no error"
        except TraceError as e:
            got = str(e)
        check(what, got, want)

    # The reader and the plan, against hand-made traces (the crate's messages).
    events, _ = read_rmm(SMALL)
    plan = Plan(events)
    check(
        "small: events, allocations, streams, threads",
        (len(events), plan.allocations(), plan.streams, plan.threads),
        (8, 4, 2, 2),
    )
    check("small: peak requested (3000 + 600 + 5000)", plan.peak_requested(), 8600)
    check(
        "small: recorded failures, never freed (slot, size)",
        (plan.recorded_failures, plan.never_freed),
        (1, [(2, 600)]),
    )
    row = lambda action, addr: f"1,10:00:00.1,{action},{addr},8,0x0\n"
    free10, alloc10 = row("free", "0x10"), row("allocate", "0x10")
    raises(
        "free of a pointer never allocated",
        HEADER + "\n" + free10,
        "event 0: free of 0x10, which the trace never allocated",
    )
    raises(
        "double free",
        HEADER + "\n" + alloc10 + free10 + free10,
        "event 2: double free of 0x10 (event 1 freed it)",
    )
    raises(
        "allocation at a live address",
        HEADER + "\n" + alloc10 + alloc10,
        "event 1: allocation at 0x10, which event 0 allocated and the trace has not freed",
    )
    raises(
        "not an RMM log",
        "Thread,Time\n",
        f"line 1: not an RMM log: the header is not `{HEADER}`",
    )
    raises(
        "a bad line",
        HEADER + "\ngarbage\n",
        "line 2: expected 6 fields (Thread,Time,Action,Pointer,Size,Stream), found 1: `garbage`",
    )
    raises(
        "a bad time",
        HEADER + "\n1,25:00:00.1,free,0x10,8,0x0\n",
        "line 2: time `25:00:00.1` is not HH:MM:SS.ffffff",
    )
    raises(
        "a null pointer",
        HEADER + "\n" + row("allocate", "(nil)"),
        "line 2: `allocate` with a null pointer",
    )
    ev, skipped = read_rmm(HEADER + "\ngarbage\n" + free10, lenient=True)
    lp = Plan(ev, lenient=True)
    check(
        "lenient: a bad line and a bad event skipped",
        (len(skipped), len(lp.skipped), len(lp.ops)),
        (1, 1, 0),
    )
    check("percentiles: nearest rank, half away from zero", percentiles([4, 1, 3, 2]), (3, 4))

    # A PyTorch snapshot: alloc / free_requested replayed, free_completed and segments not,
    # an oom a recorded failure, a global refused.
    snap = {"segments": [], "device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 2 << 20, "stream": 0},
        {"action": "alloc", "addr": 16, "size": 100, "stream": 0},
        {"action": "alloc", "addr": 32, "size": 50, "stream": 7},
        {"action": "free_requested", "addr": 16, "size": 100, "stream": 0},
        {"action": "free_completed", "addr": 16, "size": 100, "stream": 0},
        {"action": "oom", "size": 1 << 40, "stream": 0},
    ]]}
    sp = Plan(read_snapshot(pickle.dumps(snap, protocol=4))[0])
    check(
        "snapshot: allocations, streams, peak, failures, never freed",
        (sp.allocations(), sp.streams, sp.peak_requested(), sp.recorded_failures, sp.never_freed),
        (2, 2, 150, 1, [(1, 50)]),
    )
    try:
        read_snapshot(b"\x80\x02cos\nsystem\nq\x00.")
        got = "no error"
    except TraceError as e:
        got = str(e).split(":")[0:2]
    check("snapshot: a global is refused", got, ["input", " bad pickle"])

    # Every allocator's child process, on a random trace, against the rows' own figures:
    # the fake pool directly, and torch and cupy through the stand-ins in tools/peers_fakes
    # (their API surface, not their allocators).
    text, never = random_csv(23, 3000)
    want = expected_from_rows(text)
    counts = (want["allocations"], want["frees"], want["peak"], 0, never)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "random.csv")
        with open(path, "w") as f:
            f.write(text)
        plan = load(path, False)
        check("random: plan's peak requested = the rows'", plan.peak_requested(), want["peak"])
        args = argparse.Namespace(trace=path, device=0, lenient=False, torch_public=False)
        # An inherited setting does not reach the children: plain torch stays plain.
        inherited = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        results = {name: run_child(name, args, FAKES) for name in ["empty", "fake"] + PEERS}
        if inherited is None:
            del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = inherited
        for name, r in results.items():
            got = tuple(r[k] for k in ("allocations", "frees", "peak_requested", "failures", "never_freed"))
            check(f"{name}: allocations, frees, peak requested, failures, never freed", got, counts)
            if name != "empty":
                what = f"{name}: peak reserved = the size classes' from the rows"
                check(what, r["peak_reserved"], want["reserved"])
            if name.startswith("torch"):
                check(f"{name}: expandable segments as asked", r["is_expandable"], name == "torch-expandable")
        args.torch_public = True
        r = run_child("torch", args, FAKES)
        check(
            "torch --torch-public: the public calls, the same peak reserved",
            (r["api"].startswith("torch.cuda."), r["peak_reserved"]),
            (True, want["reserved"]),
        )
        args.torch_public = False
        # Failures: a limit on the pools; the replay goes on, skipping the failed blocks' frees.
        limit = want["reserved"] // 2
        os.environ["PEERS_FAKE_LIMIT"] = str(limit)
        try:
            for name in ["fake", "torch", "cupy", "cupy-async"]:
                r = run_child(name, args, FAKES)
                check(
                    f"{name} under a limit: some allocations fail, the others replay",
                    (r["failures"] > 0, r["allocations"] + r["failures"]),
                    (True, want["allocations"]),
                )
                check(f"{name} under a limit: peak reserved within it", r["peak_reserved"] <= limit, True)
        finally:
            del os.environ["PEERS_FAKE_LIMIT"]
        # The parent: the table, the JSON, and a missing library reported, not a crash.
        out = os.path.join(d, "out.json")
        me = [sys.executable, os.path.abspath(__file__), path]
        p = subprocess.run(
            me + ["--allocators", "fake,torch", "--json", out, "--fakes"], capture_output=True, text=True
        )
        check("parent: exit status", p.returncode, 0)
        check("parent: the header and a row per allocator and the empty loop", p.stdout.count("\n| "), 4)
        with open(out) as f:
            doc = json.load(f)
        check("parent: JSON rows", [r["name"] for r in doc["tables"][0]["rows"]], ["empty", "fake", "torch"])
        if not real_cupy:
            env = dict(os.environ, PYTHONPATH=os.path.join(d, "nothing"))
            p = subprocess.run(me + ["--allocators", "cupy"], capture_output=True, text=True, env=env)
            check(
                "parent without cupy: exit 1, the notes say why",
                (p.returncode, "CuPy MemoryPool: did not run" in p.stdout),
                (1, True),
            )
    print(f"self-test: {'ok' if all(checks) else 'FAILED'} ({sum(checks)}/{len(checks)} checks)")
    return 0 if all(checks) else 1


def _has(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--allocators", default=",".join(PEERS))
    ap.add_argument("--json")
    ap.add_argument("--lenient", action="store_true")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--torch-public", action="store_true")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--fakes", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=KNOWN, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.trace:
        ap.error("no TRACE given")
    if a.child:
        return child_main(a)
    return main_replay(a)


if __name__ == "__main__":
    sys.exit(main())
