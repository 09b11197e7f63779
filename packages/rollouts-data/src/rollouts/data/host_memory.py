"""Host memory reused from step to step for the large arrays a step builds (packed micro-batches, a
broadcast's staging bytes).

A step of 1024 x 4096 tokens packs ~180 MB of micro-batch arrays. Fresh memory costs a page fault
and the kernel zeroing every page on its first write: measured, filling a fresh 32 MB array took
20x as long as filling one already touched, and most of packing's time was that. The previous
step's arrays are dead by the time the next step packs, so their memory can be written again.

`HostMemoryPool.take(n)` gives a writable uint8 array of n bytes. Its memory goes back to the pool
when nothing views it any more (every numpy view, slice, `reshape` or `torch.from_numpy` of it
keeps it taken), never earlier: the arrays hold a lease object whose finalizer returns the memory.
So reuse needs no call from the user and can never hand out memory that is still visible. The pool
keeps at most `max_free_bytes` of returned memory (the most recently returned first; trimmed
whenever it is next used: `take`, `free_bytes`, `clear`), so what it holds between steps is
bounded; `clear()` gives it all back. Memory is reused only for a request
of its own size class (powers of two from 1 MiB), so a small array kept long never holds a step's
large block.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["HostMemoryPool", "default_pool"]

_ALIGN = 64
"""Every carved array starts on a cache line (and so on any dtype's alignment)."""


def _aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the alignment every carved array starts on."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _size_class(nbytes: int) -> int:
    """The allocation for a request of `nbytes`: the next power of two from 1 MiB. Pages never
    written cost nothing, and a step a little longer than the last still finds its memory."""
    return max(1 << 20, 1 << (nbytes - 1).bit_length())


class HostMemoryPool:
    """Reusable host memory, returned when every array viewing it is gone (thread-safe)."""

    def __init__(self, *, max_free_bytes: int = 1 << 30) -> None:
        if isinstance(max_free_bytes, bool) or not isinstance(max_free_bytes, int) or max_free_bytes < 0:
            raise ValueError(f"max_free_bytes must be an int >= 0, got {max_free_bytes!r}")
        self.max_free_bytes = max_free_bytes
        self._free: list[np.ndarray] = []
        """Returned allocations, the most recently returned last."""
        self._returned: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        """Blocks whose lease has gone, not yet moved to `_free`. A finalizer runs wherever the last
        view dies, a garbage collection inside this pool's own locked section included, so it only
        puts the block here (SimpleQueue.put is safe there) and never takes the lock."""
        self._lock = threading.Lock()
        self.allocations = 0
        """How many times the pool had nothing free that fit and allocated (reuse shows as no growth)."""

    def take(self, nbytes: int) -> np.ndarray:
        """A writable, uninitialised uint8 array of `nbytes` (64-byte aligned), from memory no live
        array sees. It returns to the pool when it and every view of it are gone."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        size = _size_class(nbytes)
        block: np.ndarray | None = None
        with self._lock:
            self._take_returned()
            for i in range(len(self._free) - 1, -1, -1):  # the most recently returned of its class
                if self._free[i].nbytes == size:
                    block = self._free.pop(i)
                    break
            else:
                self.allocations += 1
        if block is None:
            raw = np.empty(size + _ALIGN, dtype=np.uint8)  # numpy asks for huge pages
            start = -raw.__array_interface__["data"][0] % _ALIGN
            block = raw[start : start + size]
        # Every array handed out holds the lease through its chain of bases (a view keeps its base
        # alive, and the first array's base is the lease); when the last one goes, the lease goes,
        # and its finalizer returns the block.
        lease: Any = (ctypes.c_char * block.nbytes).from_buffer(block)  # type: ignore[arg-type]
        weakref.finalize(lease, self._returned.put, block).atexit = False
        out: np.ndarray = np.frombuffer(lease, dtype=np.uint8, count=nbytes)
        return out

    def _take_returned(self) -> None:
        """Move returned blocks to the free list and trim it to the bound (under the lock)."""
        while True:
            try:
                self._free.append(self._returned.get_nowait())
            except queue.Empty:
                break
        held = sum(b.nbytes for b in self._free)
        while held > self.max_free_bytes:  # drop the longest-unused first
            held -= self._free.pop(0).nbytes

    @property
    def free_bytes(self) -> int:
        """Bytes held for reuse (allocated, viewed by no array)."""
        with self._lock:
            self._take_returned()
            return sum(b.nbytes for b in self._free)

    def clear(self) -> None:
        """Give every free allocation back to the system (taken memory returns as it is freed)."""
        with self._lock:
            self._take_returned()
            self._free.clear()


default_pool = HostMemoryPool()
"""The pool packing (`rollouts.data.pack_samples`) takes its arrays from unless given another, and
rollouts.loops' broadcast staging its buffer."""


def carve(pool: HostMemoryPool, specs: list[tuple[int, np.dtype]]) -> list[np.ndarray]:
    """One allocation from `pool` cut into 1-D arrays of (length, dtype) each, 64-byte aligned;
    every one keeps the whole allocation taken."""
    nbytes = [n * np.dtype(dtype).itemsize for n, dtype in specs]
    block = pool.take(sum(_aligned(b) for b in nbytes))
    out, offset = [], 0
    for (_, dtype), size in zip(specs, nbytes, strict=True):
        out.append(block[offset : offset + size].view(dtype))
        offset += _aligned(size)
    return out
