"""Where a weight sync spends its time: bench_sync.py's `--phases` breakdown.

`Phases` times, per sync, each HTTP call an engine client makes (by path; /collective_rpc by its
method), the seconds the worker extension reports for its own steps (its answers' "seconds"), and
the trainer-side functions named in `TRAINER_STEPS` (found by name where the module has them; they
may run in threads, so the sums can overlap each other and the calls).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

TRAINER_STEPS = {
    "rollouts.sync.vllm": ("fingerprint", "fingerprint_dir", "tensor_rpc_bodies", "raw_tensors", "safetensors_header"),
    "rollouts.sync.broadcast": ("fingerprint_torch", "broadcast_from_trainer", "_full"),
    "rollouts.sync.broadcast_pieces": ("_pack",),
}
"""Module -> the trainer-side functions timed in it (what a module lacks is skipped)."""


class Phases:
    """Seconds per phase of each sync, accumulated while `installed(engine)`; `sync()` marks one sync."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[str, float] = defaultdict(float)
        self.syncs: list[dict[str, float]] = []

    def add(self, key: str, seconds: float) -> None:
        with self._lock:
            self._current[key] += seconds

    @contextmanager
    def sync(self) -> Iterator[None]:
        """One sync: its phases become one row of `syncs`, with its wall time as "total"."""
        with self._lock:
            self._current = defaultdict(float)
        start = time.perf_counter()
        yield
        self.add("total (wall)", time.perf_counter() - start)
        with self._lock:
            self.syncs.append(dict(self._current))

    @contextmanager
    def step(self, key: str) -> Iterator[None]:
        """Time the body as phase `key`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - start)

    def _timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - start)

        return timed

    @contextmanager
    def installed(self, engine: Any) -> Iterator[None]:
        """Time `engine`'s HTTP calls and the trainer-side steps until exit (then restored)."""
        import importlib

        patched: list[tuple[Any, str, Any]] = []
        for module_name, names in TRAINER_STEPS.items():
            module = importlib.import_module(module_name)
            for name in names:
                if hasattr(module, name):
                    original = getattr(module, name)
                    patched.append((module, name, original))
                    setattr(module, name, self._timed(f"trainer {name}", original))
        call = engine._call

        async def timed_call(method: str, path: str, **kwargs: Any) -> Any:
            body = kwargs.get("json") or {}
            key = f"http {path}" + (f" {body.get('method')}" if path == "/collective_rpc" else "")
            start = time.perf_counter()
            response = await call(method, path, **kwargs)
            self.add(key, time.perf_counter() - start)
            if path == "/collective_rpc" and response.content:
                results = response.json().get("results") or []
                first = results[0] if results and isinstance(results[0], dict) else {}
                for step, seconds in (first.get("seconds") or {}).items():  # worker 0's own steps
                    self.add(f"  worker {step}", float(seconds))
            return response

        engine._call = timed_call
        try:
            yield
        finally:
            del engine._call
            for module, name, original in patched:
                setattr(module, name, original)

    def table(self, title: str) -> str:
        """Median seconds per phase over the syncs, slowest first."""
        keys = sorted({k for row in self.syncs for k in row})
        medians = {k: statistics.median(row.get(k, 0.0) for row in self.syncs) for k in keys}
        lines = [f"  {title}: phases, median of {len(self.syncs)} syncs (seconds)"]
        lines += [f"    {k:<44} {v:>8.3f}" for k, v in sorted(medians.items(), key=lambda kv: -kv[1])]
        return "\n".join(lines)
