"""The run's startup objects kept out of Python's full garbage collections.

A training process holds a few hundred thousand long-lived objects from its imports and setup
(torch, transformers, the model's modules). Python's full collection walks all of them each time
it runs, and a large step (thousands of new objects) sets one off every few steps
(benchmarks/bench_bookkeeping.py measures it). `gc.freeze()` moves the
objects alive now to a permanent generation that collections skip; they live for the whole run
anyway. The loops freeze once setup is done and unfreeze when the run ends, so the process is
left as it was found.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["startup_objects_frozen"]


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """Collect once, freeze what is alive for the block, unfreeze after it (also on error). Nests:
    an inner block freezes only what is new and leaves the outer frozen objects frozen."""
    already = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if already == 0:  # the outermost block: give the objects back to the collector
            gc.unfreeze()
