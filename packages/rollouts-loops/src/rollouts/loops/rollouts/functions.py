"""Rollout functions: one prompt record -> a group of Samples, using any InferenceEngine.

A rollout function is `rollout(record, ctx) -> Sequence[Sample]` (sync or async), where `ctx` is a
RolloutContext: the engine, the sampling parameters (with n = samples per prompt), the tokenizer and
the prompt encoder. The loop scores the group with the run's reward and hands it to the rollout
manager (retries, over-sampling, filters, carry-over). Built in: `single_turn_rollout` (the default)
and `tool_rollout` (multi-turn, token-in/token-out, tool output masked out of the loss).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollouts.data import AsyncRolloutManager, DataBuffer, encode_bounded
from rollouts.data.manager import TailCut
from rollouts.data.manager_gate import EngineCalls
from rollouts.data.prompts import MAX_CHARS_PER_TOKEN
from rollouts.data.rollout import num_episodes
from rollouts.data.user_code import AsyncLoop, call_user, function_name
from rollouts.loops.rollouts.continued import ContinuingEngine, refuse_partial_episodes
from rollouts.loops.rollouts.multiturn import (
    ToolExecutor,
    ToolParser,
    call_environment,
    part_seed,
    run_episodes,
    run_tool_rollout,
)
from rollouts.loops.rollouts.scoring import REWARD_ERROR_KEY, GroupScorer, Reward
from rollouts.sync.partial import PARTIAL, continue_partials
from rollouts.types import Abortable, FilterFn, InferenceEngine, RLConfig, Sample, SamplingParams

PromptEncoder = Callable[[Any], Sequence[int]]
"""Turns a prompt record (from the DataBuffer) into prompt token ids."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutContext:
    """What a rollout function may use."""

    engine: InferenceEngine
    sampling: SamplingParams
    """Sampling parameters; `n` is the number of samples the group must hold."""
    encode_prompt: PromptEncoder
    tokenizer: Any = None
    vocab_size: int | None = None
    """The trained model's vocabulary: a token id at or above it is an error naming the engine."""
    max_sample_tokens: int | None = None
    """rl.max_tokens_per_micro_batch: a longer sample fails its group (it would fit no micro-batch)."""


RolloutFn = Callable[[Any, RolloutContext], "Sequence[Sample] | Awaitable[Sequence[Sample]]"]


def record_metadata(record: Any) -> dict[str, Any]:
    """The record's fields other than the prompt (answer, tests, ...), carried on each Sample."""
    return {k: v for k, v in record.items() if k != "prompt"} if isinstance(record, Mapping) else {}


def _with_record(samples: Sequence[Sample], record: Any) -> list[Sample]:
    prompt = record.get("prompt", "") if isinstance(record, Mapping) else str(record)
    prompt = prompt if isinstance(prompt, str) else tuple(prompt)
    metadata = record_metadata(record)
    return [s.replace(prompt=prompt, metadata={**s.metadata, **metadata}) for s in samples]


async def single_turn_rollout(record: Any, ctx: RolloutContext) -> list[Sample]:
    """The default: n completions of the encoded prompt in one engine call."""
    return await ctx.engine.generate([list(ctx.encode_prompt(record))], ctx.sampling)


def tool_rollout(
    *,
    tool_parser: ToolParser,
    tool_executor: ToolExecutor,
    format_tool_output: Callable[[str], str] = lambda text: text,
    max_turns: int = 4,
    max_total_tokens: int = 4096,
    tool_timeout_s: float = 30.0,
    async_loop: AsyncLoop = "asyncio",
) -> RolloutFn:
    """A rollout function running n multi-turn tool trajectories concurrently (see run_tool_rollout).

    Each tool call is bounded by `tool_timeout_s` (a sync tool runs in a worker thread, abandoned
    at the bound; an async one is cancelled): a tool that fails or hangs is an EnvironmentFailure
    naming it and the cause, and fails its group, which the rollout manager retries and counts,
    never the run. An async tool runs in an asyncio event loop (`async_loop="asyncio"`: asyncio
    code works) or the rollout's own ("caller": trio code). Trajectory i of a seeded group samples
    with `part_seed(ctx.sampling.seed, i)` (multiturn's module docstring), so they differ.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if not tool_timeout_s > 0:
        raise ValueError(f"tool_timeout_s must be > 0, got {tool_timeout_s}")
    where = f"tool {function_name(tool_executor)}"

    async def bounded_executor(call: Any) -> Any:
        return await call_environment(tool_executor, call, timeout_s=tool_timeout_s, where=where, async_loop=async_loop)

    async def rollout(record: Any, ctx: RolloutContext) -> list[Sample]:
        if ctx.tokenizer is None:
            raise ValueError("tool_rollout needs a tokenizer in the RolloutContext (to encode tool output)")
        prompt_ids = list(ctx.encode_prompt(record))

        async def one(i: int) -> Sample:
            return await run_tool_rollout(
                ctx.engine,
                ctx.tokenizer,
                prompt_ids,
                dataclasses.replace(ctx.sampling, seed=part_seed(ctx.sampling.seed, i)),
                tool_parser=tool_parser,
                tool_executor=bounded_executor,
                format_tool_output=format_tool_output,
                max_turns=max_turns,
                max_total_tokens=max_total_tokens,
            )

        return await run_episodes(ctx.sampling.n, one)

    return rollout


def model_vocab_size(model: Any) -> int | None:
    """Rows of an HF model's input embedding (its config's vocab_size otherwise; None if neither)."""
    get = getattr(model, "get_input_embeddings", None)
    rows = getattr(get(), "num_embeddings", None) if callable(get) else None
    rows = rows if rows is not None else getattr(getattr(model, "config", None), "vocab_size", None)
    return int(rows) if rows is not None else None


def check_vocabulary(samples: Sequence[Sample], *, vocab_size: int, engine: str) -> None:
    """Refuse token ids the trained model has no embedding for (an engine serving another model or
    tokenizer), naming the engine and both vocabularies, before they reach the trainer."""
    joined = b"".join(s.tokens.buffer for s in samples)  # one numpy call for the group, not one per sample
    largest = int(np.frombuffer(joined, np.int32).max()) if joined else -1
    if largest >= vocab_size:
        raise ValueError(
            f"engine {engine} returned token id {largest}, outside the trained model's vocabulary of "
            f"{vocab_size} tokens (the engine's has at least {largest + 1}): is it serving another "
            "model or tokenizer?"
        )


def check_fits(samples: Sequence[Sample], *, max_tokens: int) -> None:
    """Refuse a sample longer than a micro-batch (found here, its group fails and says why, instead
    of the trainer failing the whole step)."""
    for s in samples:
        if len(s.tokens) > max_tokens:
            raise ValueError(
                f"a sample has {len(s.tokens)} tokens (prompt {s.num_prompt_tokens} + response "
                f"{s.response_length}) > rl.max_tokens_per_micro_batch={max_tokens}: it fits no "
                "micro-batch; raise the setting or shorten the prompt"
            )


def check_prompt_lengths(
    records: Sequence[Any],
    encode_prompt: PromptEncoder,
    *,
    max_new_tokens: int,
    max_context: int | None,
    max_sample_tokens: int | None,
) -> None:
    """Refuse, before any work, prompt records whose prompt plus `max_new_tokens` cannot fit the
    model's context (`max_context`, e.g. max_position_embeddings) or one micro-batch
    (`max_sample_tokens`, rl.max_tokens_per_micro_batch); the error counts them and names the
    first few by record number and prompt. An encoder that fails is named with its record too."""
    limits = [
        (limit, name)
        for limit, name in (
            (max_context, "the model's max_position_embeddings"),
            (max_sample_tokens, "rl.max_tokens_per_micro_batch"),
        )
        if limit is not None
    ]
    if not limits:
        return
    too_long = []
    budget = max(min(limit for limit, _ in limits) - max_new_tokens, 0)
    field = getattr(encode_prompt, "field", "prompt")
    for i, record in enumerate(records):
        text = record.get(field) if isinstance(record, Mapping) else record
        try:
            if isinstance(text, str) and len(text) > max(budget, 1) * MAX_CHARS_PER_TOKEN:
                # a huge prompt is measured by its prefixes, never tokenized whole
                ids = encode_bounded(_prompt_of(encode_prompt, record, field), text, budget)
                if ids is None:
                    too_long.append(f"record {i} ({len(text)} characters, over {budget} prompt tokens, {text!r:.60})")
                    continue
            num = len(encode_prompt(record))
        except Exception as e:
            raise ValueError(f"prompt record {i}: encode_prompt failed: {type(e).__name__}: {e}") from e
        for limit, name in limits:
            if num + max_new_tokens > limit:
                prompt = record.get("prompt", record) if isinstance(record, dict) else record
                too_long.append(f"record {i} ({num} prompt tokens, {prompt!r:.60}) > {name}={limit}")
                break
    if too_long:
        raise ValueError(
            f"{len(too_long)} of {len(records)} prompts cannot fit with rollout.sampling.max_new_tokens="
            f"{max_new_tokens}: "
            + "; ".join(too_long[:5])
            + ("; ..." if len(too_long) > 5 else "")
            + ". Remove or shorten them, or lower max_new_tokens"
        )


def _prompt_of(encode_prompt: PromptEncoder, record: Any, field: str) -> Callable[[str], Sequence[int]]:
    """text -> the ids of `record` with `text` as its prompt."""

    def encode(text: str) -> Sequence[int]:
        return encode_prompt({**record, field: text} if isinstance(record, Mapping) else text)

    return encode


GREEDY_REWARD_KEY = "greedy_reward"
"""Sample metadata: the reward of the greedy response to the sample's prompt (ReMax's baseline)."""


_ROLLOUT_TIMEOUT_S = math.inf  # the rollout manager bounds each request (rollout.request_timeout_s)


def group_generator(
    rollout: RolloutFn,
    ctx: RolloutContext,
    scorer: GroupScorer,
    *,
    greedy_baseline: bool = False,
    in_place: bool = False,
) -> Callable[[Any, int], Awaitable[list[Sample]]]:
    """The rollout manager's GenerateFn: (record, n) -> n scored Samples carrying the record's fields.

    `seed` (passed by the manager when the run is seeded: one per prompt position) replaces the
    sampling seed for this group's requests. `greedy_baseline` (ReMax): one more rollout of the
    prompt at temperature 0, scored and not trained on; its reward goes into every sample's
    metadata["greedy_reward"] (a reward error of it is the samples' reward error). A group cut
    short by an engine abort (partial samples, rollouts.sync.partial) comes back unscored, to be
    continued by `group_continuer` and scored then. With `in_place` (partial multi-turn rollouts)
    it takes the manager's `engine_calls` instead, and the rollout's engine calls go through a
    ContinuingEngine: its episodes are continued in place across a sync (rollouts.continued).
    `scorer` scores the groups (shared by all the groups of a run, so that their reward calls
    batch together)."""

    async def generate_group(record: Any, n: int, *, seed: int | None = None) -> list[Sample]:
        return await generate(record, n, _group_context(ctx, n, seed))

    async def generate_episodes(
        record: Any, n: int, *, seed: int | None = None, engine_calls: EngineCalls | None = None
    ) -> list[Sample]:
        group_ctx = _group_context(ctx, n, seed)
        if engine_calls is not None:
            group_ctx = dataclasses.replace(group_ctx, engine=ContinuingEngine(ctx.engine, engine_calls))
        return await generate(record, n, group_ctx)

    async def generate(record: Any, n: int, group_ctx: RolloutContext) -> list[Sample]:
        samples = await call_user(rollout, record, group_ctx, timeout_s=_ROLLOUT_TIMEOUT_S)
        # n episodes: one Sample each, or several for an episode split into pieces (rollouts.data EPISODE_KEY)
        if (
            not isinstance(samples, Sequence)
            or not all(isinstance(s, Sample) for s in samples)
            or num_episodes(samples) != n
        ):
            raise TypeError(f"the rollout function must return {n} Samples, got {samples!r:.120}")
        return await _finish_group(rollout, ctx, scorer, samples, record, greedy_baseline=greedy_baseline)

    return generate_episodes if in_place else generate_group


def _group_context(ctx: RolloutContext, n: int, seed: int | None) -> RolloutContext:
    sampling = _seeded(ctx.sampling, n, seed)
    return ctx if sampling is ctx.sampling else dataclasses.replace(ctx, sampling=sampling)


def check_partial_rollouts(config: RLConfig, rollout: RolloutFn) -> None:
    """Refuse rl.rollout.partial where what is cut short cannot be continued: ReMax (its greedy
    baseline rollout), and a multi-turn rollout (any but the single-turn one, whose episodes are
    continued in place) with tail 'first_n' (its cut tail is carried to the next step as partial
    groups, and an episode cannot be carried: its environment lives in the rollout function)."""
    name = getattr(rollout, "__name__", rollout)
    if config.rollout.partial and rollout is not single_turn_rollout and config.rollout.tail == "first_n":
        raise ValueError(
            f"rl.rollout.partial with tail 'first_n' carries the cut tail to the next step from its tokens; "
            f"the episodes of rollout {name!r} are continued in place across a sync but cannot be carried "
            "(their environment, tools or agent live in the rollout function): use tail 'wait'"
        )
    if config.rollout.partial and config.algorithm.advantage_estimator == "remax":
        raise ValueError("rl.rollout.partial does not take advantage_estimator 'remax' (its greedy baseline rollout)")


def rollout_manager(
    buffer: DataBuffer,
    config: RLConfig,
    rollout: RolloutFn,
    ctx: RolloutContext,
    reward: Reward,
    filter_fn: FilterFn | None,
) -> AsyncRolloutManager:
    """The loop's rollout manager: groups from `rollout` scored with `reward` (ReMax: with its greedy
    baseline); with rl.rollout.partial, groups cut short continued on the engine (`group_continuer`),
    and with tail 'first_n' the tail cut short by the engine's abort() (`tail_controls`)."""
    remax = config.algorithm.advantage_estimator == "remax"  # a greedy rollout per prompt as the baseline
    scorer = GroupScorer(reward)  # one for new and continued groups: their reward calls batch together
    in_place = config.rollout.partial and rollout is not single_turn_rollout  # episodes continued in place
    continuer = group_continuer(ctx, scorer) if config.rollout.partial else None
    return AsyncRolloutManager(
        buffer,
        config.rollout,
        group_generator(rollout, ctx, scorer, greedy_baseline=remax, in_place=in_place),
        filter_fn=filter_fn,
        source=ctx.engine.name,
        continue_fn=refuse_partial_episodes if in_place else continuer,
        max_staleness=config.max_staleness,  # a partial group carried past it is restarted, not trained stale
        tail_cut=tail_controls(ctx.engine, config),
    )


def tail_controls(engine: InferenceEngine, config: RLConfig) -> TailCut | None:
    """The manager's interrupt and resume for partial rollouts with tail 'first_n': the engine's
    abort() and resume(), which it must have; none otherwise."""
    if not (config.rollout.partial and config.rollout.tail == "first_n"):
        return None
    if not isinstance(engine, Abortable):
        raise ValueError(
            f"rl.rollout.partial with tail 'first_n' cuts the tail short with the engine's abort() and "
            f"resume(); engine {engine.name} ({type(engine).__name__}) has no such methods"
        )
    return TailCut(interrupt=engine.abort, resume=engine.resume)


def group_continuer(
    ctx: RolloutContext, scorer: GroupScorer, *, greedy_baseline: bool = False
) -> Callable[..., Awaitable[list[Sample]]]:
    """The rollout manager's continue_fn for single-turn rollouts: (record, group) -> the group with
    each partial sample continued on `ctx.engine` (prompt + partial response, the remaining budget
    of max_new_tokens; rollouts.sync.partial.continue_partials), so its tokens keep the log-probs
    and weight versions that made them; scored (as `group_generator` scores) once none is partial."""

    async def continue_group(record: Any, group: Sequence[Sample], *, seed: int | None = None) -> list[Sample]:
        todo = [i for i, s in enumerate(group) if s.metadata.get(PARTIAL)]
        params = _seeded(ctx.sampling, 1, seed)
        done = await continue_partials(ctx.engine, [group[i] for i in todo], params)
        samples = list(group)
        for i, s in zip(todo, done, strict=True):
            samples[i] = s
        return await _finish_group(single_turn_rollout, ctx, scorer, samples, record, greedy_baseline=greedy_baseline)

    return continue_group


def _seeded(sampling: SamplingParams, n: int, seed: int | None) -> SamplingParams:
    if sampling.n != n or (seed is not None and sampling.seed != seed):
        return dataclasses.replace(sampling, n=n, seed=sampling.seed if seed is None else seed)
    return sampling


async def _finish_group(
    rollout: RolloutFn,
    ctx: RolloutContext,
    scorer: GroupScorer,
    samples: Sequence[Sample],
    record: Any,
    *,
    greedy_baseline: bool,
) -> list[Sample]:
    """Check a generated group, then score it (with ReMax's greedy baseline); a group still holding
    partial samples is returned unscored."""
    if ctx.vocab_size is not None:
        check_vocabulary(samples, vocab_size=ctx.vocab_size, engine=ctx.engine.name)
    if any(s.metadata.get(PARTIAL) for s in samples):
        return _with_record(samples, record)
    if ctx.max_sample_tokens is not None:
        check_fits(samples, max_tokens=ctx.max_sample_tokens)
    scored = await scorer.score(_with_record(samples, record), record)
    if not greedy_baseline:
        return scored
    greedy_ctx = dataclasses.replace(ctx, sampling=dataclasses.replace(ctx.sampling, n=1, temperature=0.0))
    greedy = await call_user(rollout, record, greedy_ctx, timeout_s=_ROLLOUT_TIMEOUT_S)
    if not isinstance(greedy, Sequence) or len(greedy) != 1 or not isinstance(greedy[0], Sample):
        raise TypeError(f"the rollout function must return 1 Sample for the greedy baseline, got {greedy!r:.120}")
    (baseline,) = await scorer.score(_with_record(greedy, record), record)
    extra: dict[str, Any] = {GREEDY_REWARD_KEY: baseline.reward}
    if REWARD_ERROR_KEY in baseline.metadata:
        extra[REWARD_ERROR_KEY] = f"greedy baseline: {baseline.metadata[REWARD_ERROR_KEY]}"
    return [s.with_metadata(**extra) for s in scored]
