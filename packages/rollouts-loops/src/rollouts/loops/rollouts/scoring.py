"""Rewards as users write them: per sample or batched, sync or async, with an error policy.

A reward function is one of (rollouts.types.RewardFn and BatchedRewardFn)
  per sample:  reward(sample, record) -> float            (or an awaitable of one)
  batched:     reward(samples, records) -> list[float]    (marked with `batched_reward`, or
                                                           `batched = true` in the config)
where `record` is the prompt record the samples were generated from (its answer, tests, ...),
each call its own copy of it (`own_copy`: an edit in place never reaches the next sample's grading). A batched
reward returns any 1-D sequence of numbers, one per sample (a list, a tuple, a numpy array; an exception fails its sample alone).
`GroupScorer` scores groups with one; it is called through rollouts.data.user_code.call_user, its
sync calls in worker threads of a pool of `Reward.max_threads` of their own.
A reward that raises, times out, or returns a non-number or a non-finite value is a *reward error*:
with on_error="raise" the step stops with the first error's message and the count; with "zero"
the sample scores 0.0 and carries the error in metadata["reward_error"], counted in the step's
metrics, unless every reward of the step failed: nothing is left to learn from, and the step stops
as with "raise". Errors are never retried (a deterministic grader fails the same way again).
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import trio

from rollouts.data.user_code import (
    DEFAULT_USER_THREADS,
    UserThreads,
    UserThreadsExhausted,
    call_user,
    function_name,
    own_copy,
    user_error_text,
)
from rollouts.types import BatchedRewardFn, RewardFn, Sample

OnError = Literal["raise", "zero"]
REWARD_ERROR_KEY = "reward_error"
"""Sample.metadata key holding '<ExceptionType>: <message>' of a failed reward."""


def batched_reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn(samples, records) -> list[float]` as a batched reward (one call per group)."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


@dataclass(frozen=True, slots=True, kw_only=True)
class Reward:
    """A reward function with its calling convention and error policy."""

    fn: RewardFn | BatchedRewardFn
    batched: bool = False
    """fn(samples, records) -> list[float] for a whole group, instead of fn(sample, record) -> float."""
    on_error: OnError = "raise"
    timeout_s: float = 60.0
    """Bound on one call (a hung grader or sandbox fails that call, not the run)."""
    max_threads: int = DEFAULT_USER_THREADS
    """Worker threads for sync calls, apart from the loop's own; a call abandoned at its bound
    holds its thread until it returns, and once all are held new calls fail at once."""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"Reward.fn must be callable, got {type(self.fn).__name__}")
        if self.on_error not in ("raise", "zero"):
            raise ValueError(f"Reward.on_error must be 'raise' or 'zero', got {self.on_error!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"Reward.timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if isinstance(self.max_threads, bool) or not isinstance(self.max_threads, int) or self.max_threads < 1:
            raise ValueError(f"Reward.max_threads must be an int >= 1, got {self.max_threads!r}")

    @classmethod
    def of(cls, fn: RewardFn | BatchedRewardFn | Reward, **options: Any) -> Reward:
        """`fn` as a Reward (a function marked with `batched_reward` is batched)."""
        if isinstance(fn, Reward):
            return fn
        return cls(fn=fn, batched=bool(getattr(fn, "batched", False)), **options)


class RewardError(RuntimeError):
    """A reward failed with on_error="raise"."""


class _Calls:
    """A group's reward calls in one worker thread, as the event loop sees them."""

    def __init__(self, num_calls: int) -> None:
        self.lock = threading.Lock()
        self.results: list[Any] = [_PENDING] * num_calls
        self.current, self.started = 0, time.monotonic()
        self.abandoned = False
        self.refused: UserThreadsExhausted | None = None  # no thread of the pool was free of hung calls
        self.spent_s = 0.0  # seconds the finished calls took


_PENDING = object()


_GATHER_PASSES = 8  # scheduler passes a batch of reward calls waits for groups to join, at most
_THREAD_WORK_S = 0.005  # a batch's calls are split over threads of about this much estimated work


@dataclass(slots=True, eq=False)
class _Job:
    """One group's sync reward calls, waiting to run in a batch led by another group's task."""

    samples: Sequence[Sample]
    record: Any
    done: trio.Event
    results: list[Any] | None = None  # None once done: the leader was cancelled, run them yourself


@dataclass(slots=True, eq=False)
class _Grader:
    """One sync reward function: the batch gathering now, and its cost per call (see GroupScorer)."""

    fn: Callable[..., Any]
    timeout_s: float
    pool: UserThreads
    gathering: list[_Job] | None = None
    call_s: float | None = None  # mean seconds per call measured so far; None before any

    async def run(self, samples: Sequence[Sample], record: Any) -> list[Any]:
        job = _Job(samples=samples, record=record, done=trio.Event())
        if self.gathering is not None:  # a leader is gathering: ride along
            self.gathering.append(job)
            await job.done.wait()
            if job.results is not None:
                return job.results
            return await self._calls([job])
        jobs = self.gathering = [job]
        try:
            size, passes = 0, 0
            while len(jobs) != size and passes < _GATHER_PASSES:  # another pass while groups still join
                size, passes = len(jobs), passes + 1
                await trio.sleep(0)
        finally:
            self.gathering = None  # later groups start a batch of their own
        try:
            await self._run_batch(jobs)
        except BaseException:
            for other in jobs:
                other.results = None  # each joined group runs its own calls
                other.done.set()
            raise
        assert job.results is not None
        return job.results

    async def _run_batch(self, jobs: list[_Job]) -> None:
        """The jobs' calls over as few threads as keep each near `_THREAD_WORK_S` of measured work:
        one for cheap graders, one per group (each a thread of its own) until a cost is known."""
        calls = sum(len(j.samples) for j in jobs)
        threads = len(jobs) if self.call_s is None else math.ceil(self.call_s * calls / _THREAD_WORK_S)
        chunks = _split(jobs, max(1, min(threads, len(jobs))))
        results: list[list[Any]] = [[] for _ in chunks]

        async def one(i: int) -> None:
            results[i] = await self._calls(chunks[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(chunks)):
                nursery.start_soon(one, i)
        for chunk, values in zip(chunks, results, strict=True):
            start = 0
            for j in chunk:
                j.results, start = values[start : start + len(j.samples)], start + len(j.samples)
                j.done.set()

    async def _calls(self, jobs: list[_Job]) -> list[Any]:
        samples = [s for j in jobs for s in j.samples]
        values, spent_s = await _sync_rewards(
            self.fn, samples, [j.record for j in jobs for _ in j.samples], timeout_s=self.timeout_s, pool=self.pool
        )
        if samples:  # the calls' own time in their thread (not the hop's), a running mean
            per_call = spent_s / len(samples)
            self.call_s = per_call if self.call_s is None else 0.8 * self.call_s + 0.2 * per_call
        return values


def _split(jobs: list[_Job], parts: int) -> list[list[_Job]]:
    """`jobs` in `parts` contiguous runs of about equal length (in jobs)."""
    size, extra = divmod(len(jobs), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(jobs[start:end])
        start = end
    return out


async def _sync_rewards(
    fn: Callable[..., Any], samples: Sequence[Sample], records: Sequence[Any], *, timeout_s: float, pool: UserThreads
) -> tuple[list[Any], float]:
    """fn(sample, record) for each sample and its record in turn, in ONE worker thread; (an entry
    per sample, the seconds the calls took). Each entry is the value (an awaitable one awaited
    here) or the exception. Each call is bounded by `timeout_s` as `call_user` bounds it: past it
    that sample gets a TimeoutError (counted as `timeout_s`), the thread is abandoned, and the
    samples after it run one `call_user` each."""
    if not samples:
        return [], 0.0
    calls = _Calls(len(samples))

    def work() -> None:
        for i, (sample, record) in enumerate(zip(samples, records, strict=True)):
            with calls.lock:
                if calls.abandoned:
                    return
                calls.current, calls.started = i, time.monotonic()
            try:
                value: Any = fn(sample, own_copy(record))
            except Exception as e:
                value = e
            with calls.lock:
                calls.results[i] = value
                calls.spent_s += time.monotonic() - calls.started

    finished = trio.Event()

    async def run() -> None:
        try:
            await pool.run_sync(work, name=function_name(fn))
        except UserThreadsExhausted as e:
            calls.refused = e
        finished.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        while not finished.is_set():
            with calls.lock:
                running = calls.results[calls.current] is _PENDING
                left_s = calls.started + timeout_s - time.monotonic() if running else timeout_s
                if left_s <= 0:  # the call in progress is past its bound
                    calls.abandoned = True
            if calls.abandoned:
                nursery.cancel_scope.cancel()
                break
            with trio.move_on_after(left_s):  # the next call starts later, so its bound ends later
                await finished.wait()
    with calls.lock:
        results, spent_s = list(calls.results), calls.spent_s
    if calls.refused is not None:
        return [calls.refused] * len(samples), 0.0
    for i, value in enumerate(results):
        if i == calls.current and value is _PENDING:
            results[i] = TimeoutError(f"{function_name(fn)} took longer than {timeout_s} s")
            spent_s += timeout_s
        elif value is _PENDING:  # after the abandoned call: each alone, its own bound
            results[i] = await _bounded_result(fn, samples[i], own_copy(records[i]), timeout_s=timeout_s, pool=pool)
        elif inspect.isawaitable(value):  # the sync reward handed back an awaitable: awaited here, bounded
            results[i] = await _bounded_result(_awaited, value, timeout_s=timeout_s, pool=pool)
    return results, spent_s


async def _awaited(value: Awaitable[Any]) -> Any:
    return await value


async def _bounded_result(fn: Callable[..., Any], *args: Any, timeout_s: float, pool: UserThreads) -> Any:
    """call_user's value, or the exception it raised."""
    try:
        return await call_user(fn, *args, timeout_s=timeout_s, limiter=pool)
    except Exception as e:
        return e


def _as_reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"the reward returned {value!r} ({type(value).__name__}), not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"the reward returned {number}, not a finite number")
    return number


class GroupScorer:
    """Scores groups with one Reward; made and held by whoever runs the rewards (the rollout
    manager's group functions, an evaluation), shared by all the groups it scores.

    A sync per-sample reward is called in a worker thread, and the calls of groups that finish in
    the same scheduler passes (the groups of one batched engine call come back together) share one
    thread hop: a hop per group costs the event loop, and beside an overlapped training step the
    interpreter lock, far more than a typical grader. The first group leads: it waits while others
    join (a few scheduler passes, no clock time), then runs the batch's calls in as few threads as
    keep each near `_THREAD_WORK_S` of measured work (one thread per group until a cost is
    measured, as slow graders need), each call still bounded by `reward.timeout_s`, and hands each
    group its results. A cancelled leader leaves each group that joined it to run its own calls.
    """

    def __init__(self, reward: Reward) -> None:
        self.reward = reward
        self._pool = UserThreads(reward.max_threads)
        self._grader = _Grader(fn=reward.fn, timeout_s=reward.timeout_s, pool=self._pool)

    async def score(self, samples: Sequence[Sample], record: Mapping[str, Any] | Any) -> list[Sample]:
        """The group's samples with rewards; failed ones per the error policy (module docstring)."""
        reward = self.reward
        if reward.batched:
            results = await _batched_results(reward, samples, record, self._pool)
        elif not inspect.iscoroutinefunction(reward.fn):
            results = [
                user_error_text(value) if isinstance(value, Exception) else _checked(value)
                for value in await self._grader.run(samples, record)  # an entry per sample: value or exception
            ]
        else:
            results = []
            for sample in samples:
                try:
                    value = await call_user(reward.fn, sample, own_copy(record), timeout_s=reward.timeout_s)
                except Exception as e:
                    results.append(user_error_text(e))
                else:
                    results.append(_checked(value))
        out = []
        for sample, result in zip(samples, results, strict=True):
            if isinstance(result, str):
                out.append(sample.with_reward(0.0).with_metadata(**{REWARD_ERROR_KEY: result}))
            else:
                out.append(sample.with_reward(result))
        return out


async def _batched_results(
    reward: Reward, samples: Sequence[Sample], record: Any, pool: UserThreads
) -> list[float | str]:
    """A batched reward's value or error text per sample; one error fails the whole group."""
    records = [own_copy(record) for _ in samples]
    try:
        values = _one_per_sample(
            await call_user(reward.fn, list(samples), records, timeout_s=reward.timeout_s, limiter=pool), len(samples)
        )
    except Exception as e:
        return [user_error_text(e)] * len(samples)
    return [_checked(v) for v in values]


def _one_per_sample(values: Any, num: int) -> list[Any]:
    """A batched reward's return as a list of `num` entries: any 1-D sequence (list, tuple, numpy
    array, ...) of that length; anything else is a TypeError naming its type and length or shape."""
    shape = getattr(values, "shape", None)
    one_d = shape is not None and len(shape) == 1  # an array: numpy's is no collections Sequence
    if isinstance(values, (str, bytes)) or not (one_d or (shape is None and isinstance(values, Sequence))):
        size = (
            f"shape {tuple(shape)}"
            if shape is not None
            else f"length {len(values)}"
            if hasattr(values, "__len__")
            else "no length"
        )
        raise TypeError(
            f"a batched reward must return a 1-D sequence of {num} numbers (list, tuple, numpy array), "
            f"got {type(values).__name__} of {size}: {values!r:.80}"
        )
    if len(values) != num:
        raise TypeError(
            f"a batched reward must return {num} numbers, one per sample, got {type(values).__name__} of "
            f"length {len(values)}: {values!r:.80}"
        )
    return list(values)


def _checked(value: Any) -> float | str:
    """The reward `value` as a finite float, or the error text of why it is not one."""
    try:
        return _as_reward(value) if not isinstance(value, Exception) else user_error_text(value)
    except (TypeError, ValueError) as e:
        return user_error_text(e)


def reward_errors(samples: Sequence[Sample]) -> list[str]:
    """The reward errors carried by `samples`, in order."""
    return [str(s.metadata[REWARD_ERROR_KEY]) for s in samples if REWARD_ERROR_KEY in s.metadata]


def check_reward_errors(samples: Sequence[Sample], on_error: OnError) -> None:
    """Raise RewardError quoting the first errors when on_error="raise" and any sample failed, or
    whatever on_error is, when every sample failed (a step of zeros has nothing to learn from)."""
    errors = reward_errors(samples)
    every = bool(errors) and len(errors) == len(samples)
    if errors and (on_error == "raise" or every):
        hint = (
            "every reward of the step failed: a step of zeros has nothing to learn from, whatever on_error says"
            if every
            else 'set on_error = "zero" to score failures 0 and go on'
        )
        raise RewardError(f"{len(errors)} of {len(samples)} rewards failed; first: {summarize(errors)} ({hint})")


def summarize(errors: Sequence[str], *, limit: int = 3) -> str:
    """The most common errors with their counts, most common first: "'E: m' x3; 'F: n' x1"."""
    counts: dict[str, int] = {}
    for e in errors:
        counts[e] = counts.get(e, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return "; ".join(f"{text[:200]!r} x{n}" for text, n in top)
