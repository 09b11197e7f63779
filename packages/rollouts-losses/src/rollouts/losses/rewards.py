"""Reward functions on text and Samples, and batch reward normalization and clipping.

Legend: B samples. Reward functions follow rollouts.types.RewardFn: Sample -> float.

`math_answer_reward` reads the reference answer from `sample.metadata["answer"]` (the key is an
option) and extracts the response's final answer in this order: the last \\boxed{...}, the text
after the last "answer is", else the last number. Answers compare numerically when both parse as
numbers (integers, decimals, thousands separators, a/b and \\frac{a}{b}, a trailing %), else as
normalized strings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction

import torch
from rollouts.types import RewardFn, Sample
from torch import Tensor

__all__ = [
    "clip_rewards",
    "combine_rewards",
    "extract_answer",
    "format_reward",
    "math_answer_reward",
    "normalize_rewards",
    "overlong_penalty",
    "overlong_reward",
    "score_math_answer",
]

ANSWER_REL_TOL = 1e-6
"""Relative tolerance of a numeric answer match: 0.333333 counts as 1/3, 0.33 does not."""
ANSWER_ABS_TOL = 1e-9
"""Absolute tolerance of a numeric answer match, for answers equal to 0."""
NORMALIZE_EPS = 1e-6
"""Added to the batch std in normalize_rewards: a batch whose rewards all agree normalizes to 0."""

# Thousands groups only as d,ddd: a comma after a number ("12, so") is punctuation, not part of it.
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*(.+)", re.IGNORECASE)
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces matched; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in a response: last \\boxed{}, else after the last "answer is", else the last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        tail = matches[-1].group(1).strip().split("\n")[0]
        tail = re.sub(r"[.\s]+$", "", tail).strip("$ ")
        if tail:
            return tail
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalize(answer: str) -> str:
    """Strip markup that does not change the answer: $, \\text{}, \\left/\\right, spaces, a final period."""
    s = _TEXT.sub(r"\1", answer.strip())
    s = s.replace("$", "").replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    return s.lower()


def _as_number(answer: str) -> float | None:
    """The answer as a number (1,000 / 2.5 / -3/4 / \\frac{3}{4} / 50%), or None."""
    s = _normalize(answer)
    percent = s.endswith("\\%") or s.endswith("%")
    s = s.removesuffix("\\%").removesuffix("%")
    frac = _FRAC.match(s)
    if frac:
        s = f"{frac.group(1)}/{frac.group(2)}"
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    try:
        value = float(Fraction(s))
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100.0 if percent else value


def score_math_answer(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference answer (numerically when both are numbers), else 0.0."""
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    a, b = _as_number(predicted), _as_number(answer)
    if a is not None and b is not None:
        return float(math.isclose(a, b, rel_tol=ANSWER_REL_TOL, abs_tol=ANSWER_ABS_TOL))
    return float(_normalize(predicted) == _normalize(answer))


def math_answer_reward(sample: Sample, *, answer_key: str = "answer") -> float:
    """RewardFn: score_math_answer(sample.response, sample.metadata[answer_key])."""
    if answer_key not in sample.metadata:
        raise ValueError(
            f"sample.metadata has no {answer_key!r} (keys: {sorted(sample.metadata)}): "
            "math_answer_reward needs the reference answer there"
        )
    return score_math_answer(sample.response, str(sample.metadata[answer_key]))


def format_reward(pattern: str, *, full_match: bool = True, score: float = 1.0) -> RewardFn:
    """RewardFn giving `score` when the response matches the regex pattern (whole response by default), else 0."""
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from exc

    def reward(sample: Sample) -> float:
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

    def reward(sample: Sample) -> float:
        """The soft overlong penalty of this sample's response (<= 0)."""
        return overlong_penalty(
            sample.response_length, max_length=max_length, buffer_length=buffer_length, factor=factor
        )

    return reward


def combine_rewards(fns: Sequence[Callable[[Sample], float]], weights: Sequence[float]) -> RewardFn:
    """RewardFn: the weighted sum of several reward functions."""
    fns, weights = tuple(fns), tuple(float(w) for w in weights)
    if len(fns) != len(weights) or not fns:
        raise ValueError(f"need one weight per reward function and at least one, got {len(fns)} fns, {len(weights)} weights")

    def reward(sample: Sample) -> float:
        """sum of weight * fn(sample)."""
        return sum(w * fn(sample) for fn, w in zip(fns, weights, strict=True))

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
