"""Agent programs as a rollout function: each episode runs the user's agent against its own base URL.

An agent is `async def run(base_url: str, record: dict) -> float | None` (a plain function works
too) using any OpenAI-compatible client pointed at `base_url`. An async agent runs in the process's
one asyncio event loop (rollouts.data.user_code.AsyncioThread, a thread of its own), so asyncio
clients (openai.AsyncOpenAI, httpx, ...) work as they do anywhere, and a client an agent drops
unclosed is closed later in the loop it was made in; a plain function runs in a worker thread. Each
episode is bounded by `timeout_s` (past it the episode fails: its asyncio task is cancelled, a
worker thread abandoned). An agent that blocks the event loop (a sync sleep in an async function)
holds back the other episodes, which then end at their own bounds. Its
return is the episode's reward (metadata["agent_reward"], which `agent_reward` reads); None leaves
the episode to the run's reward function, which gets the episode's whole text as `sample.response`
and its last chat messages as metadata["transcript"].

A failed episode (the agent raised, timed out, returned something other than a number or None,
made no request, or was answered with an engine failure) fails its group with an AgentError naming
the agent, the episode and the cause; the rollout manager retries the group and counts it.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from rollouts.data.user_code import call_user, function_name, own_copy, user_error_text
from rollouts.loops.agents.endpoint import EndpointLimits, Episode, serve_agent_endpoint
from rollouts.loops.rollouts.functions import RolloutContext, RolloutFn
from rollouts.loops.rollouts.scoring import Reward
from rollouts.types import BatchedRewardFn, RewardFn, Sample

__all__ = ["AGENT_REWARD_KEY", "AgentError", "AgentFn", "agent_reward", "agent_rollout"]

AgentFn = Callable[[str, Any], "Awaitable[float | None] | float | None"]
"""run(base_url, record) -> the episode's reward, or None (sync or async)."""

AGENT_REWARD_KEY = "agent_reward"
"""Sample.metadata: the reward the agent returned for its episode."""


class AgentError(RuntimeError):
    """An episode of an agent failed; the message names the agent, the episode and the cause."""


def agent_rollout(
    agent_fn: AgentFn,
    *,
    tokenizer: Any = None,
    timeout_s: float = 300.0,
    limits: EndpointLimits | None = None,
    name: str | None = None,
) -> RolloutFn:
    """A rollout function running `ctx.sampling.n` episodes of `agent_fn` concurrently, each through
    its own base URL of an agent endpoint served for the group (endpoint.serve_agent_endpoint).

    `tokenizer` renders chat messages with its chat template (default: the RolloutContext's);
    `timeout_s` bounds one episode; `limits` bounds its requests; `name` names the agent in errors
    (default: the function's name)."""
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if not callable(agent_fn):
        raise TypeError(f"agent_fn must be callable, got {type(agent_fn).__name__}")
    label = name or function_name(agent_fn)
    endpoint_limits = limits if limits is not None else EndpointLimits()

    async def rollout(record: Any, ctx: RolloutContext) -> list[Sample]:
        tok = tokenizer if tokenizer is not None else ctx.tokenizer
        if tok is None:
            raise ValueError("agent_rollout needs a tokenizer (its chat template renders the agent's messages)")
        n = ctx.sampling.n
        results: list[list[Sample]] = [[] for _ in range(n)]

        def decode(ids: Sequence[int]) -> str:
            return str(tok.decode(list(ids), skip_special_tokens=True))

        try:
            async with serve_agent_endpoint(ctx.engine, tok, ctx.sampling, endpoint_limits) as endpoint:

                async def one(i: int) -> None:
                    episode = endpoint.open_episode(index=i, seed=ctx.sampling.seed)
                    try:
                        reward = await _run_agent(agent_fn, label, episode, record, timeout_s)
                    finally:
                        endpoint.close_episode(episode)
                    _check_episode(episode, label)
                    metadata = {} if reward is None else {AGENT_REWARD_KEY: reward}
                    results[i] = episode.samples(decode=decode, metadata=metadata)

                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(one, i)
        except BaseExceptionGroup as group:  # the first failed episode's own error, not a group
            raise _first(group) from None
        return [s for samples in results for s in samples]

    return rollout


async def _run_agent(agent_fn: AgentFn, label: str, episode: Episode, record: Any, timeout_s: float) -> float | None:
    """The agent's reward for `episode`: `agent_fn` awaited in the process's asyncio event loop
    (a sync one in a worker thread), bounded by `timeout_s`."""
    where = f"agent {label!r}, episode {episode.index}"
    try:
        value = await call_user(agent_fn, episode.base_url, own_copy(record), timeout_s=timeout_s, async_loop="asyncio")
    except TimeoutError as e:
        raise AgentError(f"{where}: took longer than {timeout_s} s (agent timeout_s)") from e
    except Exception as e:
        raise AgentError(f"{where}: {user_error_text(e)}") from e
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    ):
        raise AgentError(f"{where}: returned {value!r:.80}; an agent returns its reward (a finite number) or None")
    return None if value is None else float(value)


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception of `group`, out of any groups nested in it (cancellations last)."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        error = stack.pop(0)
        stack[:0] = list(error.exceptions) if isinstance(error, BaseExceptionGroup) else []
        leaves += [] if isinstance(error, BaseExceptionGroup) else [error]
    return next((e for e in leaves if isinstance(e, Exception)), group)


def _check_episode(episode: Episode, label: str) -> None:
    where = f"agent {label!r}, episode {episode.index}"
    if episode.error is not None:
        raise AgentError(f"{where}: {episode.error}")
    if not episode.turns:
        raise AgentError(f"{where}: made no request to its base URL {episode.base_url}")


def agent_reward(fallback: Reward | RewardFn | BatchedRewardFn | None = None) -> Reward:
    """A Reward giving each sample its agent's reward (metadata["agent_reward"]), and `fallback`'s
    (a run's reward function: per sample or batched) to those whose agent returned None; with no
    fallback such a sample is a reward error."""
    base = None if fallback is None else Reward.of(fallback)

    async def missing(samples: Sequence[Sample], records: Sequence[Any]) -> list[float]:
        if base is None:
            raise ValueError("the agent returned None and no reward function scores the episode")
        if base.batched:
            return [float(v) for v in await call_user(base.fn, samples, records, timeout_s=base.timeout_s)]
        return [
            float(await call_user(base.fn, s, r, timeout_s=base.timeout_s))
            for s, r in zip(samples, records, strict=True)
        ]

    async def scored(samples: Sequence[Sample], records: Sequence[Any]) -> list[float]:
        todo = [i for i, s in enumerate(samples) if AGENT_REWARD_KEY not in s.metadata]
        values = [float(s.metadata.get(AGENT_REWARD_KEY, 0.0)) for s in samples]
        if todo:
            for i, v in zip(todo, await missing([samples[i] for i in todo], [records[i] for i in todo]), strict=True):
                values[i] = v
        return values

    async def per_sample(sample: Sample, record: Any) -> float:
        (value,) = await scored([sample], [record])
        return value

    if base is not None and base.batched:
        return Reward(
            fn=scored, batched=True, on_error=base.on_error, timeout_s=base.timeout_s, max_threads=base.max_threads
        )
    if base is not None:
        return Reward(fn=per_sample, on_error=base.on_error, timeout_s=base.timeout_s, max_threads=base.max_threads)
    return Reward(fn=per_sample)
