"""The built-in rewards, each a `reward(sample, record) -> float` (rollouts.types.RewardFn) that a run
file names in `[reward] fn`: "exact_match", "math_answer" and "environment".

Each is a module-level function (with another answer key, a functools.partial of one), so a
RolloutProcess, which sends its reward to the engine process by import path and JSON keywords,
can rebuild it there.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from rollouts.loops.rollouts.environments import environment_reward
from rollouts.losses import math_answer_reward
from rollouts.types import RewardFn, Sample

__all__ = ["BUILTIN_REWARDS", "builtin_reward", "exact_match", "math_answer", "reference_answer"]

BUILTIN_REWARDS = ("math_answer", "exact_match", "environment")
"""The names `builtin_reward` knows."""


def reference_answer(sample: Sample, record: Mapping[str, Any] | None, answer_key: str) -> str:
    """The reference answer: from the prompt record, else from the fields the sample carries."""
    source = record if isinstance(record, Mapping) else sample.metadata
    if answer_key not in source:
        raise ValueError(f"the prompt record has no {answer_key!r} field (fields: {sorted(source)})")
    return str(source[answer_key])


def exact_match(sample: Sample, record: Mapping[str, Any] | None = None, *, answer_key: str = "answer") -> float:
    """1.0 when the response (stripped) is exactly the reference answer, else 0.0."""
    return 1.0 if sample.response.strip() == reference_answer(sample, record, answer_key) else 0.0


def math_answer(sample: Sample, record: Mapping[str, Any] | None = None, *, answer_key: str = "answer") -> float:
    """1.0 when the response's final answer equals the reference answer by math-verify, else 0.0
    (rollouts.losses.math_answer_reward)."""
    return math_answer_reward(sample, record, answer_key=answer_key)


def builtin_reward(name: str, *, answer_key: str = "answer") -> RewardFn:
    """The built-in reward `name` (one of BUILTIN_REWARDS) reading the reference answer under `answer_key`."""
    if name == "environment":
        return environment_reward  # the episode's own reward: no answer to read
    if name == "math_answer":
        graded = math_answer
    elif name == "exact_match":
        graded = exact_match
    else:
        raise ValueError(f"no built-in reward {name!r}: the built-ins are {list(BUILTIN_REWARDS)}")
    if answer_key == "answer":
        return graded
    return functools.partial(graded, answer_key=answer_key)
