"""Keep freed CPU memory for reuse: a training step on CPU otherwise pays page faults for its activations.

glibc's malloc hands large blocks back to the kernel as soon as they are freed: blocks above the
mmap threshold (which glibc raises only up to the largest block freed so far) are unmapped, and
the top of the heap is trimmed once more than twice that threshold is free there. A training step
frees all its activations at the end of backward, so the next step maps them again, and the
kernel zeroes every fresh page, a cost paid again every step. Raising both thresholds keeps that memory in the heap; the step reuses it.

Only glibc has these knobs (`mallopt`); elsewhere nothing changes. The setting is process-wide, as
the allocator is: it is what `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` in the
environment would do, applied by `build_components` for a model on CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["retain_freed_cpu_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
"""mallopt parameter numbers, from glibc's malloc.h."""

MMAP_THRESHOLD_BYTES = 64 * 2**20
"""Blocks up to 64 MiB come from the heap (glibc's own dynamic threshold stops at 32 MiB): one
activation of a small model's micro-batch is a few MiB; larger blocks are still mapped and unmapped."""
TRIM_THRESHOLD_BYTES = 1 * 2**30
"""Up to 1 GiB of freed heap is kept for the next step rather than handed back to the kernel."""


def retain_freed_cpu_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); True where glibc took them.

    Idempotent; returns False, changing nothing, on a C library without mallopt.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 on a value it refuses
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) & bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
