"""A stand-in for the few `cupy` calls `peers_replay.py` makes, for its --self-test on a
machine without CuPy or a GPU. Not CuPy: size-class pools behind the same names. As in
CuPy, a pool allocates on the current stream (`Stream.use()`), a block goes back to the
stream it came from when its last MemoryPointer is dropped, and the async pool's
statistics are the driver pool's attributes (`memPoolGetAttribute`).
PEERS_FAKE_LIMIT (bytes) makes allocations past it fail with OutOfMemoryError.
"""

import os
import types

from fakepool import SizeClassPool

__version__ = "0.0+peers-fake"


class OutOfMemoryError(MemoryError):
    pass


class Stream:
    _next = 0x7000
    null = None

    def __init__(self, null=False, non_blocking=False, ptds=False):
        if null:
            self.ptr = 0
        else:
            Stream._next += 0x10
            self.ptr = Stream._next

    def use(self):
        _state["stream"] = self
        return self

    def synchronize(self):
        pass


Stream.null = Stream(null=True)
_state = {"stream": Stream.null}


def _limit():
    return int(os.environ.get("PEERS_FAKE_LIMIT", "0"))


class MemoryPointer:
    def __init__(self, pool, ptr):
        self._pool, self.ptr = pool, ptr

    def __del__(self):
        if self._pool is not None and self.ptr:
            self._pool.release(self.ptr)


def _malloc(pool, size):
    if not isinstance(size, int):
        raise TypeError("size: an int")
    if size == 0:
        return MemoryPointer(None, 0)
    try:
        return MemoryPointer(pool, pool.alloc(size, _state["stream"].ptr))
    except MemoryError as e:
        raise OutOfMemoryError(str(e)) from None


class MemoryPool:
    def __init__(self, allocator=None):
        self._pool = SizeClassPool(_limit())

    def malloc(self, size):
        return _malloc(self._pool, size)

    def total_bytes(self):
        return self._pool.reserved

    def free_all_blocks(self, stream=None):
        self._pool.trim()


_DEFAULT_POOL = 0xA000
_async_pools = {}


def _async_pool():
    if _DEFAULT_POOL not in _async_pools:
        _async_pools[_DEFAULT_POOL] = SizeClassPool(_limit())
    return _async_pools[_DEFAULT_POOL]


class MemoryAsyncPool:
    def __init__(self, pool_handles="default"):
        if pool_handles != "default":
            raise NotImplementedError("fake: the default pool only")
        _async_pool()

    def malloc(self, size):
        return _malloc(_async_pool(), size)

    def total_bytes(self):
        return _async_pool().reserved

    def free_all_blocks(self, stream=None):
        _async_pool().trim()


class Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else device

    def use(self):
        if not isinstance(self.id, int):
            raise TypeError("device: an int")

    def synchronize(self):
        pass


def _get_attr(pool, attr):
    p = _async_pools[pool]
    if attr == 5:
        return p.reserved
    if attr == 6:
        return p.peak_reserved
    raise ValueError(f"fake: attribute {attr}")


def _set_attr(pool, attr, value):
    p = _async_pools[pool]
    if attr != 6 or value != 0:
        raise ValueError("fake: only ReservedMemHigh, reset to 0")
    p.reset_peak()


runtime = types.SimpleNamespace(
    deviceSynchronize=lambda: None,
    deviceGetDefaultMemPool=lambda device: _DEFAULT_POOL,
    memPoolGetAttribute=_get_attr,
    memPoolSetAttribute=_set_attr,
    cudaMemPoolAttrReservedMemCurrent=5,
    cudaMemPoolAttrReservedMemHigh=6,
    getDeviceProperties=lambda device: {"name": b"fake GPU (peers self-test)"},
    runtimeGetVersion=lambda: 0,
    driverGetVersion=lambda: 0,
)

cuda = types.SimpleNamespace(
    Stream=Stream,
    MemoryPool=MemoryPool,
    MemoryAsyncPool=MemoryAsyncPool,
    MemoryPointer=MemoryPointer,
    Device=Device,
    runtime=runtime,
    OutOfMemoryError=OutOfMemoryError,
)
