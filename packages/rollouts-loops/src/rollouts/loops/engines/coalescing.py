"""Coalescing of concurrent requests into one batched call of an in-process engine.

The rollout manager sends one request per group; a remote server batches them itself, but the
in-process sampler runs one forward pass per call. `CoalescingEngine` gathers the requests that
arrive together into one batched call of the engine's synchronous core (`SyncSampler.sample`,
run in a worker thread so the event loop, and with it timeouts and overlapped training, keep
running).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import trio

from rollouts.types import Abortable, InferenceEngine, Sample, SamplingParams, SyncSampler, WeightLoader

_DEFAULT_WINDOW_S = 0.01  # long enough for a nursery's start_soon burst, short next to a forward pass
_QUIET_PASSES = 3  # scheduler passes without a new caller before the first batch goes out
log = logging.getLogger(__name__)


class SyncEngine(SyncSampler, InferenceEngine, Protocol):
    """What CoalescingEngine wraps: an InferenceEngine with a synchronous core (InProcessEngine,
    rollouts.backends' ProcessEngine)."""


@dataclass(slots=True)
class _Request:
    prompts: Sequence[Sequence[int]]
    params: SamplingParams
    wake: trio.Event = field(default_factory=trio.Event)
    """Set once the request is finished, or when it is handed the lead."""
    finished: bool = False
    result: list[Sample] | None = None
    error: BaseException | None = None
    gone: bool = False
    """Its caller stopped waiting (cancelled): never queued again, never handed the lead."""


class CoalescingEngine:
    """Wraps an engine whose sampling blocks (a SyncSampler): batches concurrent calls and runs
    them in a thread.

    Calls with equal SamplingParams that arrive together go out as one `sample` call of at most
    `max_prompts_per_call` prompts: the first caller after a quiet spell waits while others are
    still joining (a few scheduler passes for a burst of `start_soon` tasks; at most `window_s`;
    `adaptive=False` waits `window_s` flat), and calls that queue while a batch runs form the
    next. An inner engine with `check_prompts(prompts, params)` (InProcessEngine) has each call's
    prompts checked before they queue: a prompt it refuses fails its own caller at once, naming the
    cause, and the batch goes out without it; a batch that fails anyway runs again in halves, split
    again where they fail, so only the calls that fail by themselves see an error. Seeded
    one-prompt calls that differ only in their seed go out together too, with a seed
    per prompt: each prompt keeps its own random stream, so a seeded run's samples do not depend
    on which calls happened to share a batch. Other methods pass straight through.

    One waiting caller at a time leads: it runs batches (its own first) until its own request is
    finished, then hands the lead to the next queued caller. So no caller's deadline covers other
    callers' batches, and a cancelled leader hands on what is still queued instead of failing it.
    A caller cancelled while its batch runs gets its cancellation once the batch returns; `abort()`
    cuts the running batch short where the inner engine is Abortable (InProcessEngine.abort: the
    rows still generating come back as partial Samples, to continue with rollouts.sync.partial).
    The wrapper is a WeightLoader exactly when its inner engine is one.
    """

    def __init__(
        self,
        inner: SyncEngine,
        *,
        max_prompts_per_call: int = 64,
        window_s: float = _DEFAULT_WINDOW_S,
        adaptive: bool = True,
    ) -> None:
        if not isinstance(inner, SyncSampler):
            raise TypeError(
                f"CoalescingEngine runs its inner engine's blocking sample(prompts, params, seeds) in a worker "
                f"thread; {type(inner).__name__} has none (InProcessEngine and ProcessEngine have)"
            )
        if max_prompts_per_call < 1:
            raise ValueError(f"max_prompts_per_call must be >= 1, got {max_prompts_per_call}")
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.inner = inner
        self.max_prompts_per_call = max_prompts_per_call
        self.window_s = window_s
        self.adaptive = adaptive
        self._queue: list[_Request] = []
        self._leader: _Request | None = None
        if isinstance(inner, WeightLoader):
            # An attribute of this instance, not a method of the class: the wrapper passes the
            # WeightLoader check (where a sync is set up) only when its inner engine does.
            self.load_weights = inner.load_weights

    @property
    def name(self) -> str:
        return self.inner.name

    @staticmethod
    def _key(r: _Request) -> SamplingParams:
        """Requests with equal keys go out in one call. A one-prompt request's seed is not part of
        the key: it goes to the inner engine as that prompt's seed."""
        if r.params.seed is not None and len(r.prompts) == 1:
            return dataclasses.replace(r.params, seed=None)
        return r.params

    async def _run_batch(self, batch: list[_Request]) -> None:
        prompts = [p for r in batch for p in r.prompts]
        params = self._key(batch[0])
        seeded = params.seed is None and any(r.params.seed is not None for r in batch)
        seeds = [r.params.seed for r in batch] if seeded else None  # one prompt each (see _key)
        try:
            samples = await trio.to_thread.run_sync(functools.partial(self.inner.sample, prompts, params, seeds))
        except trio.Cancelled:  # before the thread started (a running one is waited for): nothing ran
            self._queue[:0] = [r for r in batch if not r.gone]  # a caller gone meanwhile waits for nothing
            raise
        except Exception as e:
            if len(batch) == 1:  # the request sees its failure (and may retry)
                self._finish(batch, error=e)
                return
            # One bad request must not fail the others with it: the batch runs again as two halves,
            # each split again only if it fails, so only the requests that fail by themselves see an
            # error, and one bad request among N costs about 2 log2(N) calls, not N.
            half = len(batch) // 2
            parts = [batch[:half], batch[half:]]
            for i, part in enumerate(parts):
                try:
                    await self._run_batch(part)
                except trio.Cancelled:  # part's unfinished requests went back to the queue's front
                    back = sum(not (r.finished or r.gone) for r in part)
                    self._queue[back:back] = [r for later in parts[i + 1 :] for r in later if not r.gone]
                    raise
            return
        if len(samples) != len(prompts) * params.n:
            error = RuntimeError(
                f"{self.inner.name} returned {len(samples)} samples for {len(prompts)} prompts x n={params.n}"
            )
            self._finish(batch, error=error)
            return
        start = 0
        for r in batch:
            size = len(r.prompts) * params.n
            r.result = samples[start : start + size]
            start += size
        self._finish(batch)

    async def _gather(self) -> None:
        """Wait for concurrent callers to join the first batch: with `adaptive`, only while the
        queue is still filling (it grew during the last scheduler pass) and not full, at most
        `window_s`; otherwise `window_s` flat."""
        if not self.adaptive:
            await trio.sleep(self.window_s)
            return
        deadline = trio.current_time() + self.window_s
        queued, quiet = self._num_queued(), 0
        while quiet < _QUIET_PASSES and queued < self.max_prompts_per_call and trio.current_time() < deadline:
            await trio.sleep(0)  # one scheduler pass: callers started beside this one run up to their generate
            now = self._num_queued()
            quiet = quiet + 1 if now == queued else 0
            queued = now

    def _num_queued(self) -> int:
        return sum(len(r.prompts) for r in self._queue)

    @staticmethod
    def _finish(batch: list[_Request], *, error: BaseException | None = None) -> None:
        for r in batch:
            r.error, r.finished = error, True
            r.wake.set()

    def _take_batch(self) -> list[_Request]:
        key = self._key(self._queue[0])
        batch: list[_Request] = []
        rest: list[_Request] = []
        num = 0
        for r in self._queue:
            if self._key(r) == key and (not batch or num + len(r.prompts) <= self.max_prompts_per_call):
                batch.append(r)
                num += len(r.prompts)
            else:
                rest.append(r)
        self._queue = rest
        return batch

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Sample]:
        """Queue the call; it returns once a batch holding it has run (led by this caller or another).
        Prompts the inner engine refuses by its `check_prompts(prompts, params)`, where it has one
        (InProcessEngine: empty, ids outside the vocabulary, too long), fail this call at once."""
        check = getattr(self.inner, "check_prompts", None)
        if callable(check):  # a bad prompt never joins a batch, whose failure would run every caller alone
            check(prompts, params)
        request = _Request(prompts=prompts, params=params)
        self._queue.append(request)
        try:
            if self._leader is None:  # the first call after a quiet spell waits for others to join
                self._leader = request
                await self._gather()
            while not request.finished:
                if self._leader is request:
                    await self._run_batch(self._take_batch())
                else:
                    await request.wake.wait()
        finally:
            request.gone = not request.finished
            if request in self._queue:  # cancelled before its batch ran: its prompts are not generated
                self._queue.remove(request)
            if self._leader is request:
                self._leader = self._queue[0] if self._queue else None
                if self._leader is not None:
                    self._leader.wake.set()
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def abort(self) -> None:
        """The inner engine's abort(): generation in progress ends early with partial Samples."""
        self._abortable("abort").abort()

    def resume(self) -> None:
        """The inner engine's resume(): generation runs to the end again."""
        self._abortable("resume").resume()

    def close(self) -> None:
        """The inner engine's close(), where it has one (ProcessEngine: its process is reaped)."""
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()

    def _abortable(self, method: str) -> Abortable:
        if not isinstance(self.inner, Abortable):
            raise TypeError(f"{self.name}: the inner engine ({type(self.inner).__name__}) has no {method}()")
        return self.inner

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        await self.inner.update_weights_from_disk(path, weight_version)

    async def weight_version(self) -> int | None:
        return await self.inner.weight_version()

    async def health(self) -> bool:
        return await self.inner.health()
