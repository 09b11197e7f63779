"""Rewards as users write them: per sample or batched, sync or async, with an error policy.

A reward function is one of
  per sample:  reward(sample, record) -> float            (or an awaitable of one)
  batched:     reward(samples, records) -> list[float]    (marked with `batched_reward`, or
                                                           `batched = true` in the config)
where `record` is the prompt record the samples were generated from (its answer, tests, ...).
A reward that raises, times out, or returns a non-number or a non-finite value is a *reward error*:
with on_error="raise" the step stops with the first error's message and the count; with "zero"
the sample scores 0.0 and carries the error in metadata["reward_error"], counted in the step's
metrics. Errors are never retried (a deterministic grader fails the same way again).
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import trio

from rollouts.types import Sample

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

    fn: Callable[..., Any]
    batched: bool = False
    """fn(samples, records) -> list[float] for a whole group, instead of fn(sample, record) -> float."""
    on_error: OnError = "raise"
    timeout_s: float = 60.0
    """Bound on one call (a hung grader or sandbox fails that call, not the run)."""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"Reward.fn must be callable, got {type(self.fn).__name__}")
        if self.on_error not in ("raise", "zero"):
            raise ValueError(f"Reward.on_error must be 'raise' or 'zero', got {self.on_error!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"Reward.timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")

    @classmethod
    def of(cls, fn: Callable[..., Any] | Reward, **options: Any) -> Reward:
        """`fn` as a Reward (a function marked with `batched_reward` is batched)."""
        if isinstance(fn, Reward):
            return fn
        return cls(fn=fn, batched=bool(getattr(fn, "batched", False)), **options)


class RewardError(RuntimeError):
    """A reward failed with on_error="raise"."""


async def call_bounded(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """fn(*args) bounded by `timeout_s` (TimeoutError naming fn beyond it): a coroutine function is
    awaited, a plain one runs in a worker thread (abandoned on timeout), and an awaitable it returns
    is awaited too."""
    try:
        with trio.fail_after(timeout_s):
            if inspect.iscoroutinefunction(fn):
                return await fn(*args)
            # boxed: a sync function may return an awaitable, awaited here rather than by to_thread
            (result,) = await trio.to_thread.run_sync(lambda: (fn(*args),), abandon_on_cancel=True)
            return await result if inspect.isawaitable(result) else result
    except trio.TooSlowError:
        raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} took longer than {timeout_s} s") from None


class _Calls:
    """A group's reward calls in one worker thread, as the event loop sees them."""

    def __init__(self, num_calls: int) -> None:
        self.lock = threading.Lock()
        self.results: list[Any] = [_PENDING] * num_calls
        self.current, self.started = 0, time.monotonic()
        self.abandoned = False


_PENDING = object()


async def _sync_rewards(
    fn: Callable[..., Any], samples: Sequence[Sample], record: Any, *, timeout_s: float
) -> list[Any]:
    """fn(sample, record) for each sample in turn, in ONE worker thread: a thread hop per sample costs
    the event loop (and, beside an overlapped training step, the interpreter lock) more than a
    typical grader. Each entry is the value (an awaitable one awaited here) or the exception. Each
    call is bounded by `timeout_s` as `call_bounded` bounds it: past it that sample gets a
    TimeoutError, the thread is abandoned, and the samples after it run one `call_bounded` each."""
    if not samples:
        return []
    calls = _Calls(len(samples))

    def work() -> None:
        for i, sample in enumerate(samples):
            with calls.lock:
                if calls.abandoned:
                    return
                calls.current, calls.started = i, time.monotonic()
            try:
                value: Any = fn(sample, record)
            except Exception as e:
                value = e
            with calls.lock:
                calls.results[i] = value

    finished = trio.Event()

    async def run() -> None:
        await trio.to_thread.run_sync(work, abandon_on_cancel=True)
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
        results = list(calls.results)
    for i, value in enumerate(results):
        if i == calls.current and value is _PENDING:
            results[i] = TimeoutError(f"{getattr(fn, '__qualname__', fn)} took longer than {timeout_s} s")
        elif value is _PENDING:  # after the abandoned call: each alone, as before
            results[i] = await _bounded_result(fn, samples[i], record, timeout_s=timeout_s)
        elif inspect.isawaitable(value):
            results[i] = await _bounded_result(lambda v=value: v, timeout_s=timeout_s)
    return results


async def _bounded_result(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """call_bounded's value, or the exception it raised."""
    try:
        return await call_bounded(fn, *args, timeout_s=timeout_s)
    except Exception as e:
        return e


def _as_reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"the reward returned {value!r} ({type(value).__name__}), not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"the reward returned {number}, not a finite number")
    return number


def _error_text(error: BaseException, timeout_s: float) -> str:
    if isinstance(error, (trio.TooSlowError, TimeoutError)):
        return f"TimeoutError: the reward took longer than {timeout_s} s"
    return f"{type(error).__name__}: {error}"


async def score_group(reward: Reward, samples: Sequence[Sample], record: Mapping[str, Any] | Any) -> list[Sample]:
    """The group's samples with rewards; failed ones per the error policy (see the module docstring)."""
    if reward.batched:
        try:
            values = await call_bounded(reward.fn, list(samples), [record] * len(samples), timeout_s=reward.timeout_s)
            if not isinstance(values, Sequence) or len(values) != len(samples):
                raise TypeError(f"a batched reward must return {len(samples)} numbers, got {values!r:.80}")
            results: list[float | str] = []
            for v in values:
                try:
                    results.append(_as_reward(v))
                except (TypeError, ValueError) as e:
                    results.append(_error_text(e, reward.timeout_s))
        except Exception as e:
            results = [_error_text(e, reward.timeout_s)] * len(samples)
    elif not inspect.iscoroutinefunction(reward.fn):
        results = []
        for value in await _sync_rewards(reward.fn, samples, record, timeout_s=reward.timeout_s):
            try:
                if isinstance(value, Exception):
                    raise value
                results.append(_as_reward(value))
            except Exception as e:
                results.append(_error_text(e, reward.timeout_s))
    else:
        results = []
        for sample in samples:
            try:
                results.append(_as_reward(await call_bounded(reward.fn, sample, record, timeout_s=reward.timeout_s)))
            except Exception as e:
                results.append(_error_text(e, reward.timeout_s))
    out = []
    for sample, result in zip(samples, results, strict=True):
        if isinstance(result, str):
            out.append(sample.with_reward(0.0).with_metadata(**{REWARD_ERROR_KEY: result}))
        else:
            out.append(sample.with_reward(result))
    return out


def reward_errors(samples: Sequence[Sample]) -> list[str]:
    """The reward errors carried by `samples`, in order."""
    return [str(s.metadata[REWARD_ERROR_KEY]) for s in samples if REWARD_ERROR_KEY in s.metadata]


def check_reward_errors(samples: Sequence[Sample], on_error: OnError) -> None:
    """Raise RewardError quoting the first errors when on_error="raise" and any sample failed."""
    errors = reward_errors(samples)
    if errors and on_error == "raise":
        raise RewardError(
            f"{len(errors)} of {len(samples)} rewards failed; first: {summarize(errors)} "
            '(set on_error = "zero" to score failures 0 and go on)'
        )


def summarize(errors: Sequence[str], *, limit: int = 3) -> str:
    """The most common errors with their counts, most common first: "'E: m' x3; 'F: n' x1"."""
    counts: dict[str, int] = {}
    for e in errors:
        counts[e] = counts.get(e, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return "; ".join(f"{text[:200]!r} x{n}" for text, n in top)
