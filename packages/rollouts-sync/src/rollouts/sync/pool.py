"""Spread generate requests over several engines: least outstanding requests, bounded per engine.

An engine leaves the rotation when a health check fails or a request to it gets no response,
and comes back after a health check passes: `check_health` / `run_health_checks`, or on its own,
once it has been out `readmit_after_s`, at the next generate call (one check per engine per
period, bounded by `health_timeout_s`), so a transient failure does not cost an engine for the rest
of a run that runs no health checks. The pool itself implements InferenceEngine, so a loop can
treat many servers as one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus

from rollouts.sync._common import check_seconds
from rollouts.sync._http import EngineError
from rollouts.sync.weight_sync import SyncResult, sync_weights_to_engines
from rollouts.types import InferenceEngine, Sample, SamplingParams


class NoHealthyEngineError(RuntimeError):
    """Every engine of the pool is out of rotation."""


class EnginePool:
    """Routes each generate call to the in-rotation engine with the fewest requests in flight."""

    def __init__(
        self,
        engines: Sequence[InferenceEngine],
        *,
        max_concurrency_per_engine: int = 32,
        health_timeout_s: float = 10.0,
        sync_timeout_s: float = 600.0,
        readmit_after_s: float = 30.0,
    ) -> None:
        if not engines:
            raise ValueError("engines is empty: a pool needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        if max_concurrency_per_engine < 1:
            raise ValueError(f"max_concurrency_per_engine must be >= 1, got {max_concurrency_per_engine}")
        check_seconds("health_timeout_s", health_timeout_s)
        check_seconds("sync_timeout_s", sync_timeout_s)
        if not readmit_after_s >= 0:
            raise ValueError(f"readmit_after_s must be >= 0, got {readmit_after_s}")
        self.readmit_after_s = readmit_after_s
        self.engines = tuple(engines)
        self.max_concurrency_per_engine = max_concurrency_per_engine
        self.health_timeout_s = health_timeout_s
        self.sync_timeout_s = sync_timeout_s
        self._limits = [anyio.Semaphore(max_concurrency_per_engine) for _ in engines]
        self._outstanding = [0] * len(engines)
        self._in_rotation = [True] * len(engines)
        self._out_since: list[float | None] = [None] * len(engines)  # when each engine out of rotation was last checked
        self._next = 0  # tie-break cursor so equal loads rotate instead of piling onto engine 0

    def __repr__(self) -> str:
        return f"EnginePool({[e.name for e in self.engines]!r}, in_rotation={self.in_rotation})"

    @property
    def name(self) -> str:
        return "pool[" + ",".join(e.name for e in self.engines) + "]"

    @property
    def in_rotation(self) -> tuple[str, ...]:
        """Names of the engines that currently receive requests."""
        return tuple(e.name for e, ok in zip(self.engines, self._in_rotation, strict=True) if ok)

    @property
    def outstanding(self) -> tuple[int, ...]:
        """[E] generate requests in flight per engine."""
        return tuple(self._outstanding)

    def _pick(self, excluded: set[int]) -> int:
        candidates = [i for i, ok in enumerate(self._in_rotation) if ok and i not in excluded]
        if not candidates:
            raise NoHealthyEngineError(
                f"no engine in rotation (out: {[e.name for i, e in enumerate(self.engines) if not self._in_rotation[i]]}"
                f", already failed this request: {[self.engines[i].name for i in sorted(excluded)]})"
            )
        n = len(self.engines)
        best = min(candidates, key=lambda i: (self._outstanding[i], (i - self._next) % n))
        self._next = (best + 1) % n
        return best

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Sample]:
        """Generate on the least-loaded engine; on no response, take it out and try the next one."""
        await self._readmit()
        tried: set[int] = set()
        while True:
            i = self._pick(tried)
            tried.add(i)
            self._outstanding[i] += 1
            try:
                async with self._limits[i]:
                    return await self.engines[i].generate(prompts, params)
            except EngineError as exc:
                if exc.status is not None and exc.status < 500:
                    raise  # the request itself is bad; another engine would refuse it too
                self._take_out(i)
                if len(tried) == len(self.engines):
                    raise
            finally:
                self._outstanding[i] -= 1

    async def check_health(self) -> tuple[str, ...]:
        """Ask every engine concurrently (each bounded by health_timeout_s); returns the in-rotation names."""
        results = [False] * len(self.engines)

        async def one(i: int) -> None:
            with anyio.move_on_after(self.health_timeout_s):
                results[i] = await self.engines[i].health()

        async with anyio.create_task_group() as tg:
            for i in range(len(self.engines)):
                tg.start_soon(one, i)
        for i, ok in enumerate(results):
            if ok:
                self._in_rotation[i], self._out_since[i] = True, None
            else:
                self._take_out(i)
        return self.in_rotation

    def _take_out(self, i: int) -> None:
        self._in_rotation[i] = False
        self._out_since[i] = time.monotonic()

    async def _readmit(self) -> None:
        """Check the engines out of rotation for `readmit_after_s` (once each per period, whoever calls);
        those that pass come back."""
        now = time.monotonic()
        due = [
            i for i, since in enumerate(self._out_since) if since is not None and now - since >= self.readmit_after_s
        ]
        if not due:
            return
        for i in due:
            self._out_since[i] = now  # the next check of this engine is a period away, whatever the outcome

        async def one(i: int) -> None:
            healthy = False
            with anyio.move_on_after(self.health_timeout_s):
                healthy = await self.engines[i].health()
            if healthy:
                self._in_rotation[i], self._out_since[i] = True, None

        async with anyio.create_task_group() as tg:
            for i in due:
                tg.start_soon(one, i)

    async def run_health_checks(
        self, *, interval_s: float, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Check health every `interval_s` until cancelled (start it with a task group's or nursery's `start`)."""
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        await self.check_health()
        task_status.started()
        while True:
            await anyio.sleep(interval_s)
            await self.check_health()

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        """Sync every engine of the pool (see sync_weights_to_engines); raises WeightSyncError on any failure."""
        await self.sync(path, weight_version)

    async def sync(self, path: str, weight_version: int) -> SyncResult:
        """Sync every engine of the pool and return what happened."""
        return await sync_weights_to_engines(self.engines, path, weight_version, timeout_s=self.sync_timeout_s)

    async def weight_version(self) -> int | None:
        """The version every in-rotation engine serves; raises if they disagree."""
        versions = {}
        for i, engine in enumerate(self.engines):
            if self._in_rotation[i]:
                versions[engine.name] = await engine.weight_version()
        if not versions:
            raise NoHealthyEngineError("no engine in rotation")
        distinct = set(versions.values())
        if len(distinct) > 1:
            raise RuntimeError(f"engines of the pool serve different weight versions: {versions}")
        return distinct.pop()

    async def health(self) -> bool:
        """Whether at least one engine is healthy (and refreshes the rotation)."""
        return bool(await self.check_health())
