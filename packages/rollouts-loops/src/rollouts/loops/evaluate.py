"""Held-out evaluation through any InferenceEngine: greedy (or sampled) answers scored by a reward."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from rollouts.types import InferenceEngine, RewardFn, Sample, SamplingParams

_EVAL_CHUNK_PROMPTS = 256  # prompts per generate call: bounds memory of the in-process sampler


async def evaluate_async(
    engine: InferenceEngine,
    records: Sequence[Mapping[str, Any]],
    encode_prompt: Any,
    reward_fn: RewardFn,
    params: SamplingParams,
) -> tuple[float, list[Sample]]:
    """(mean reward, scored samples) of one response per record; reward > 0 counts as correct."""
    if not records:
        raise ValueError("evaluate needs at least one record")
    params = dataclasses.replace(params, n=1)
    scored: list[Sample] = []
    for start in range(0, len(records), _EVAL_CHUNK_PROMPTS):
        chunk = records[start : start + _EVAL_CHUNK_PROMPTS]
        samples = await engine.generate([list(encode_prompt(r)) for r in chunk], params)
        for record, sample in zip(chunk, samples, strict=True):
            sample = sample.with_metadata(**{k: v for k, v in record.items() if k != "prompt"})
            scored.append(sample.with_reward(float(reward_fn(sample))))
    return sum(s.reward for s in scored) / len(scored), scored


def evaluate(
    engine: InferenceEngine,
    records: Sequence[Mapping[str, Any]],
    encode_prompt: Any,
    reward_fn: RewardFn,
    params: SamplingParams,
) -> tuple[float, list[Sample]]:
    """Synchronous `evaluate_async` (runs its own trio loop)."""
    return trio.run(evaluate_async, engine, records, encode_prompt, reward_fn, params)
