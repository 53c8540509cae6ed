"""A stand-in for the few `torch` calls `peers_replay.py` makes, for its --self-test on a
machine without PyTorch or a GPU. Not PyTorch: a size-class pool behind the same names,
checking its arguments the way PyTorch does (ints for the raw calls, a Stream or an int
for the stream). PYTORCH_CUDA_ALLOC_CONF is read when CUDA first comes up, as PyTorch does;
PEERS_FAKE_LIMIT (bytes) makes allocations past it fail with OutOfMemoryError.
"""

import os
import types

from fakepool import SizeClassPool

__version__ = "0.0+peers-fake"
version = types.SimpleNamespace(cuda="0.0-fake")

_state = {"pool": None, "expandable": None, "device": 0, "peak_alloc": 0, "alloc": 0, "rounded": {}}


class OutOfMemoryError(RuntimeError):
    pass


def _pool():
    if _state["pool"] is None:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        _state["expandable"] = "expandable_segments:True" in conf
        _state["pool"] = SizeClassPool(int(os.environ.get("PEERS_FAKE_LIMIT", "0")))
    return _state["pool"]


def _raw_alloc(size, stream):
    if not isinstance(size, int) or not isinstance(stream, int):
        raise TypeError("raw_alloc: size and stream must be ints")
    if size == 0:
        return 0
    try:
        addr = _pool().alloc(size, stream)
    except MemoryError as e:
        raise OutOfMemoryError(str(e)) from None
    rounded = _state["rounded"][addr] = (size + 511) // 512 * 512
    _state["alloc"] += rounded
    _state["peak_alloc"] = max(_state["peak_alloc"], _state["alloc"])
    return addr


def _raw_delete(ptr):
    if not isinstance(ptr, int):
        raise TypeError("raw_delete: ptr must be an int")
    pool = _pool()
    if ptr not in pool.live:
        raise RuntimeError("invalid device pointer: %#x" % ptr)
    _state["alloc"] -= _state["rounded"].pop(ptr)
    pool.release(ptr)


_C = types.SimpleNamespace(
    _cuda_cudaCachingAllocator_raw_alloc=_raw_alloc,
    _cuda_cudaCachingAllocator_raw_delete=_raw_delete,
)


class _Stream:
    _next = 0x5000

    def __init__(self, device=None, priority=0):
        _Stream._next += 0x10
        self.cuda_stream = _Stream._next
        self.device = device


def _device_index(device):
    if device is None:
        return _state["device"]
    if not isinstance(device, int):
        raise TypeError("device: an int here")
    return device


def caching_allocator_alloc(size, device=None, stream=None):
    _device_index(device)
    if stream is None:
        stream = 0
    if isinstance(stream, _Stream):
        stream = stream.cuda_stream
    if not isinstance(stream, int):
        raise TypeError("Invalid type for stream argument")
    return _raw_alloc(size, stream)


def caching_allocator_delete(mem_ptr):
    _raw_delete(mem_ptr)


def memory_stats(device=None):
    _device_index(device)
    pool = _pool()
    return {
        "reserved_bytes.all.current": pool.reserved,
        "reserved_bytes.all.peak": pool.peak_reserved,
        "allocated_bytes.all.peak": _state["peak_alloc"],
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


def reset_peak_memory_stats(device=None):
    _device_index(device)
    _pool().reset_peak()
    _state["peak_alloc"] = _state["alloc"]


def empty_cache():
    _pool().trim()


def memory_snapshot():
    pool = _pool()
    segs = {s for s, _ in pool.free_lists} | {v[0] for v in pool.live.values()}
    return [{"stream": s, "is_expandable": _state["expandable"]} for s in sorted(segs)]


def _set_device(device):
    _state["device"] = _device_index(device)


def _synchronize(device=None):
    _device_index(device)


cuda = types.SimpleNamespace(
    is_available=lambda: True,
    init=lambda: _pool() and None,
    set_device=_set_device,
    current_device=lambda: _state["device"],
    get_device_name=lambda device=None: "fake GPU (peers self-test)",
    Stream=_Stream,
    caching_allocator_alloc=caching_allocator_alloc,
    caching_allocator_delete=caching_allocator_delete,
    memory_stats=memory_stats,
    reset_peak_memory_stats=reset_peak_memory_stats,
    empty_cache=empty_cache,
    memory_snapshot=memory_snapshot,
    synchronize=_synchronize,
    OutOfMemoryError=OutOfMemoryError,
)
