"""Reward functions on text and Samples, and batch reward normalization and clipping.

Legend: B samples. Reward functions follow rollouts.types.RewardFn: reward(sample, record) -> float,
`record` being the prompt record the sample answers (optional here: None reads the sample alone).

`math_answer_reward` grades with math-verify (the `math` extra: `pip install rollouts-losses[math]`),
which extracts the response's final answer (\\boxed{}, "the final answer is", LaTeX or plain
expressions) and compares it with the reference symbolically: -\\frac{3}{4} equals -0.75, x=2
equals 2, \\pi/2 equals \\frac{\\pi}{2}. The reference is read as LaTeX first (so "\\frac{1}{2}"
and "0.5" both work), then as plain text.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from rollouts.types import RewardFn, Sample

__all__ = [
    "clip_rewards",
    "combine_rewards",
    "format_reward",
    "math_answer_reward",
    "normalize_rewards",
    "overlong_penalty",
    "overlong_reward",
    "score_math_answer",
]

MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own bound on parsing and on comparing one answer (it uses SIGALRM, so it applies
only on the main thread; elsewhere the caller bounds the call, as rollouts-loops' Reward does)."""
NORMALIZE_EPS = 1e-6
"""Added to the batch std in normalize_rewards: a batch whose rewards all agree normalizes to 0."""


class _NoTimeoutWarning(logging.Filter):
    """Off the main thread math-verify's SIGALRM timeout cannot work and it says so on every call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("math_answer_reward needs math-verify: pip install 'rollouts-losses[math]'") from e
    for name in ("math_verify", "math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTimeoutWarning) for f in logger.filters):
            logger.addFilter(_NoTimeoutWarning())
    return math_verify


def score_math_answer(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference answer (math-verify), else 0.0."""
    mv = _math_verify()
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(f"${answer}$", parsing_timeout=timeout) or mv.parse(answer, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"the reference answer {answer!r} cannot be parsed as math: fix the data's answer field")
    predicted = mv.parse(response, parsing_timeout=timeout) or mv.parse(f"${response}$", parsing_timeout=timeout)
    return float(bool(predicted) and mv.verify(gold, predicted, timeout_seconds=timeout))


def math_answer_reward(sample: Sample, record: Any = None, *, answer_key: str = "answer") -> float:
    """RewardFn: score_math_answer(sample.response, the reference answer), read from the prompt
    record when it is a mapping, else from sample.metadata (where the loops copy the record's fields)."""
    source, where = (
        (record, "the prompt record") if isinstance(record, Mapping) else (sample.metadata, "sample.metadata")
    )
    if answer_key not in source:
        raise ValueError(
            f"{where} has no {answer_key!r} (keys: {sorted(source)}): math_answer_reward needs the reference answer there"
        )
    return score_math_answer(sample.response, str(source[answer_key]))


def format_reward(pattern: str, *, full_match: bool = True, score: float = 1.0) -> RewardFn:
    """RewardFn giving `score` when the response matches the regex pattern (whole response by default), else 0."""
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from exc

    def reward(sample: Sample, record: Any = None) -> float:
        """score if sample.response matches the pattern, else 0.0."""
        match = regex.fullmatch(sample.response) if full_match else regex.search(sample.response)
        return score if match else 0.0

    return reward


def overlong_penalty(length: int, *, max_length: int, buffer_length: int, factor: float = 1.0) -> float:
    """DAPO soft overlong punishment: 0 up to max_length - buffer_length, then linearly to -factor at max_length."""
    if not 0 <= buffer_length <= max_length:
        raise ValueError(f"buffer_length ({buffer_length}) must be in [0, max_length={max_length}]")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    expected = max_length - buffer_length
    if length <= expected:
        return 0.0
    if length > max_length:
        return -factor
    return (expected - length) / buffer_length * factor


def overlong_reward(*, max_length: int, buffer_length: int, factor: float = 1.0) -> RewardFn:
    """RewardFn: overlong_penalty of the sample's response length in tokens."""
    overlong_penalty(0, max_length=max_length, buffer_length=buffer_length, factor=factor)  # validate now

    def reward(sample: Sample, record: Any = None) -> float:
        """The soft overlong penalty of this sample's response (<= 0)."""
        return overlong_penalty(
            sample.response_length, max_length=max_length, buffer_length=buffer_length, factor=factor
        )

    return reward


def combine_rewards(fns: Sequence[Callable[[Sample, Any], float]], weights: Sequence[float]) -> RewardFn:
    """RewardFn: the weighted sum of several sync reward functions."""
    fns, weights = tuple(fns), tuple(float(w) for w in weights)
    if len(fns) != len(weights) or not fns:
        raise ValueError(
            f"need one weight per reward function and at least one, got {len(fns)} fns, {len(weights)} weights"
        )

    def reward(sample: Sample, record: Any = None) -> float:
        """sum of weight * fn(sample, record)."""
        return sum(w * fn(sample, record) for fn, w in zip(fns, weights, strict=True))

    return reward


def normalize_rewards(rewards_B: Tensor, *, eps: float = NORMALIZE_EPS) -> Tensor:
    """[B] rewards -> [B] (r - batch mean) / (batch std + eps), unbiased std; a batch of one gives 0."""
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards must be [B], got {tuple(rewards_B.shape)}")
    if rewards_B.numel() < 2:
        return torch.zeros_like(rewards_B)
    return (rewards_B - rewards_B.mean()) / (rewards_B.std() + eps)


def clip_rewards(rewards_B: Tensor, *, min_reward: float, max_reward: float) -> Tensor:
    """[B] rewards -> [B] rewards clamped to [min_reward, max_reward]."""
    if not min_reward <= max_reward:
        raise ValueError(f"min_reward ({min_reward}) must be <= max_reward ({max_reward})")
    return torch.clamp(rewards_B, min_reward, max_reward)
