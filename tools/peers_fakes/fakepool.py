"""A size-class pool for `peers_replay.py --self-test`: power-of-two classes from 512 B, a
free list per (stream, class), new blocks from a bump pointer. Its peak reserved has a
closed form (the sum over (stream, class) of the most blocks live at once times the class),
which the self-test computes from the trace alone to check the replay's figures.
"""


def size_class(size):
    """The block a request of `size` bytes gets: the next power of two, at least 512 B."""
    return max(512, 1 << max(size - 1, 0).bit_length())


class SizeClassPool:
    def __init__(self, limit=0):
        self.limit = limit  # 0: none; else an allocation past it fails
        self.next_addr = 1 << 40
        self.reserved = 0
        self.peak_reserved = 0
        self.free_lists = {}  # (stream, class) -> [addr]
        self.live = {}  # addr -> (stream, class)
        self.allocs = 0
        self.frees = 0

    def alloc(self, size, stream):
        cls = size_class(size)
        free = self.free_lists.get((stream, cls))
        if free:
            addr = free.pop()
        else:
            if self.limit and self.reserved + cls > self.limit:
                raise MemoryError(f"fake pool: out of memory allocating {size} bytes")
            addr = self.next_addr
            self.next_addr += cls
            self.reserved += cls
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.live[addr] = (stream, cls)
        self.allocs += 1
        return addr

    def release(self, addr):
        stream, cls = self.live.pop(addr)  # KeyError: a double or foreign free
        self.free_lists.setdefault((stream, cls), []).append(addr)
        self.frees += 1

    def trim(self):
        """Gives back every free block (what empty_cache / free_all_blocks do)."""
        for (_, cls), addrs in self.free_lists.items():
            self.reserved -= cls * len(addrs)
        self.free_lists.clear()

    def reset_peak(self):
        self.peak_reserved = self.reserved
