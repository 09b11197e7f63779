"""The run's startup objects kept out of Python's full garbage collections.

A training process holds a few hundred thousand long-lived objects from its imports and setup
(torch, transformers, the model's modules). Python's full collection walks all of them each time
it runs, and a large step (thousands of new objects) sets one off every few steps
(benchmarks/bench_bookkeeping.py measures it). `gc.freeze()` moves the
objects alive now to a permanent generation that collections skip; they live for the whole run
anyway. The loops freeze once setup is done and unfreeze when the run ends, so the objects the run
leaves behind can be collected. The outermost block unfreezes everything, also what was frozen
before it: Python 3.12 starts with a few hundred objects frozen, so a count of frozen objects
cannot say which block is the outermost (a depth kept here does), and a run's objects left frozen
would never be collected.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["startup_objects_frozen"]


_depth = 0  # blocks open now, in any thread
_depth_lock = threading.Lock()


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """Collect once, freeze what is alive for the block, unfreeze after it (also on error). Nests:
    an inner block freezes only what is new and leaves the outer frozen objects frozen."""
    global _depth
    with _depth_lock:
        _depth += 1
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        with _depth_lock:
            _depth -= 1
            if _depth == 0:  # the outermost block: give the objects back to the collector
                gc.unfreeze()
