"""Multi-turn rollouts with tools, token-in / token-out.

The engine continues from the exact token ids of the conversation so far: earlier turns are never
re-tokenized (re-tokenizing decoded text can split differently and silently shift the log-probs
the trainer compares against). Tool output is appended as tokens with loss weight 0 and log-prob
0; only the engine's own tokens are trained on.

Seeds: a seeded group's episodes must differ, and so must an episode's turns, whatever requests
share the engine: episode i of a group seeded with s samples with `part_seed(s, i)`, and its turn t
with `part_seed(part_seed(s, i), t)` (the group's seed is the run's seed mixed with the prompt's
position in the data stream by the rollout manager, rollouts.data.request_seed). An unseeded run
stays unseeded.

Failures: the environment's code (an Environment's reset and step, a tool) is called through
`call_environment`: bounded in time, asyncio code run in an asyncio event loop, and any failure an
EnvironmentFailure naming the environment, the call and the cause. `run_episodes` runs a group's
episodes; the first failure cancels the others and is raised alone (not as an ExceptionGroup).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from rollouts.data import encode_bounded
from rollouts.data.user_code import (
    AsyncLoop,
    UserCodeError,
    UserCodeFailure,
    UserThreadsExhausted,
    call_user,
    user_threads,
)
from rollouts.loops.rollouts.continued import extend_segments, oldest_of
from rollouts.sync.partial import VERSION_SEGMENTS, version_segments
from rollouts.types import InferenceEngine, LogProbs, LossMask, Sample, SamplingParams, Status, TokenIds, Tokenizer

ToolParser = Callable[[str], Any | None]
"""Reads one assistant turn's text; returns a tool call to execute, or None when there is none."""
ToolExecutor = Callable[[Any], "str | Awaitable[str]"]
"""Runs a tool call; returns the text to show the model (sync or async)."""
StopCondition = Callable[[Sample, int], bool]
"""(the trajectory so far, turns taken) -> whether to stop early."""


class EnvironmentFailure(UserCodeFailure):
    """An environment's reset or step, or a tool, raised, ran past its bound or answered wrongly;
    the message names the environment (or tool), the call and the cause, `__cause__` is the error."""


def part_seed(seed: int | None, index: int) -> int | None:
    """The seed of part `index` (an episode of a group, a turn of an episode) of what `seed` seeds:
    a 63-bit blake2b hash of both (neighbouring parts get unrelated streams); None stays None."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8, person=b"rollouts-part").digest()
    return int.from_bytes(digest, "little") >> 1


async def call_environment(
    fn: Callable[..., Any], *args: Any, timeout_s: float, where: str, async_loop: AsyncLoop
) -> Any:
    """`call_user(fn, *args)` for the environment's code; any failure is an EnvironmentFailure
    whose message starts with `where` (e.g. "environment CalculatorEnv, step at turn 2")."""
    try:
        return await call_user(fn, *args, timeout_s=timeout_s, async_loop=async_loop)
    except (UserCodeError, UserThreadsExhausted) as e:
        raise EnvironmentFailure(f"{where}: {e}") from e
    except TimeoutError as e:
        sync = not inspect.iscoroutinefunction(fn)
        fate = (
            f"its worker thread is abandoned ({user_threads().hung} threads for user code hung)"
            if sync
            else "its task is cancelled"
        )
        raise EnvironmentFailure(f"{where}: {e}; {fate}") from e


async def run_episodes(num: int, episode: Callable[[int], Awaitable[Sample]]) -> list[Sample]:
    """`episode(0)` ... `episode(num - 1)` run concurrently. The first to fail cancels the others
    (the group is lost) and its error is raised alone, as the one cause of the group's failure."""
    samples: list[Sample | None] = [None] * num
    failures: list[Exception] = []
    async with trio.open_nursery() as nursery:

        async def one(i: int) -> None:
            try:
                samples[i] = await episode(i)
            except Exception as e:
                failures.append(e)
                nursery.cancel_scope.cancel()

        for i in range(num):
            nursery.start_soon(one, i)
    if failures:
        raise failures[0]
    return [s for s in samples if s is not None]


async def run_tool_rollout(
    engine: InferenceEngine,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    tool_parser: ToolParser,
    tool_executor: ToolExecutor,
    format_tool_output: Callable[[str], str] = lambda text: text,
    stop_condition: StopCondition | None = None,
    max_turns: int = 4,
    max_total_tokens: int = 4096,
) -> Sample:
    """One trajectory alternating engine turns and tool calls; returns a single Sample.

    The Sample's tokens are prompt + every turn; loss_mask is 1 on engine tokens and 0 on the
    prompt and tool output; rollout_logprobs covers every response token (0.0 on tool tokens), or
    is None when any turn came back without log-probs (a made-up 0.0 would pass for probability 1).
    Bounds: at most `max_turns` engine turns and `max_total_tokens` tokens in all. A trajectory
    cut by either bound is TRUNCATED, including when the last allowed turn still calls a tool
    (that call is not run: nothing would answer its output). `tool_executor` is called through
    rollouts.data.user_code.call_user (a sync one in a worker thread) with no bound of its own.
    `params.seed` is this trajectory's: turn t samples with `part_seed(params.seed, t)`.
    metadata["version_segments"] says which weights sampled each engine token (None on tool
    output); weight_version is the oldest (a turn continued across a sync has two).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if len(prompt_ids) >= max_total_tokens:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) leaves no room under max_total_tokens={max_total_tokens}")
    params = dataclasses.replace(params, n=1)
    tokens, mask, logprobs = list(prompt_ids), [0.0] * len(prompt_ids), []
    segments: list[list[Any]] = []  # [weight version, length] runs over the response
    num_prompt = len(prompt_ids)
    status, turns, tool_calls, all_logprobs = Status.COMPLETED, 0, 0, True
    while turns < max_turns:
        room = max_total_tokens - len(tokens)
        if room <= 0:
            status = Status.TRUNCATED
            break
        turn_params = dataclasses.replace(
            params, max_new_tokens=min(params.max_new_tokens, room), seed=part_seed(params.seed, turns)
        )
        (turn,) = await engine.generate([tokens], turn_params)
        turns += 1
        new = turn.response_tokens
        tokens += new
        mask += [1.0] * len(new)
        segments = extend_segments(segments, version_segments(turn))  # two runs for a turn cut by a sync
        all_logprobs = all_logprobs and turn.rollout_logprobs is not None
        logprobs += list(turn.rollout_logprobs) if turn.rollout_logprobs is not None else [0.0] * len(new)
        status = turn.status
        text = tokenizer.decode(new, skip_special_tokens=True)
        trajectory = Sample(
            tokens=TokenIds(tokens),
            num_prompt_tokens=num_prompt,
            loss_mask=LossMask(mask),
            rollout_logprobs=LogProbs(logprobs) if all_logprobs else None,
        )
        if status is not Status.COMPLETED or (stop_condition is not None and stop_condition(trajectory, turns)):
            break
        call = tool_parser(text)
        if call is None:
            break
        if turns >= max_turns:  # the model wants another turn it will not get
            status = Status.TRUNCATED
            break
        # no bound here: tool_rollout hands in an executor bounded by its tool_timeout_s
        output = await call_user(tool_executor, call, timeout_s=math.inf)
        room = max_total_tokens - len(tokens) - 1  # a huge tool output is measured by prefixes, not tokenized whole
        tool_ids = encode_bounded(
            lambda t: tokenizer.encode(t, add_special_tokens=False), format_tool_output(str(output)), max(room, 0)
        )
        tool_calls += 1
        if tool_ids is None or room < 0:
            status = Status.TRUNCATED
            break
        tokens += tool_ids
        mask += [0.0] * len(tool_ids)
        logprobs += [0.0] * len(tool_ids)
        segments = extend_segments(segments, [(None, len(tool_ids))])
    response_text = tokenizer.decode(tokens[num_prompt:], skip_special_tokens=True)
    return Sample(
        tokens=TokenIds(tokens),
        num_prompt_tokens=num_prompt,
        loss_mask=LossMask(mask),
        rollout_logprobs=LogProbs(logprobs) if all_logprobs else None,
        response=response_text,
        status=status,
        weight_version=oldest_of([v for v, _ in segments]),  # the oldest: a staleness bound holds for every token
        metadata={"turns": turns, "tool_calls": tool_calls, VERSION_SEGMENTS: segments},
    )
