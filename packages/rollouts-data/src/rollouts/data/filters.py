"""Group filters: FilterFn factories that judge one prompt's group of samples.

A FilterFn takes a group and returns None to keep it or a short reason string to drop it; the
reasons are counted in RolloutBatch.filter_reasons. `combine_filters` applies several in order
and reports the first reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rollouts.types import FilterFn, Sample, Status

__all__ = [
    "check_min_reward",
    "check_reasonable_length",
    "check_response_diversity",
    "check_reward_nonzero_std",
    "combine_filters",
]


def _rewards(group: Sequence[Sample], who: str) -> list[float]:
    missing = [i for i, s in enumerate(group) if s.reward is None]
    if missing:
        raise ValueError(f"{who}: group samples {missing} have no reward; apply the reward function before filtering")
    return [float(s.reward) for s in group]  # type: ignore[arg-type]


def check_reward_nonzero_std(*, min_std: float = 1e-6) -> FilterFn:
    """Drop groups whose rewards (population std) are all within `min_std`: no GRPO signal (DAPO)."""
    if not min_std >= 0.0:
        raise ValueError(f"min_std must be >= 0, got {min_std}")

    def check(group: Sequence[Sample]) -> str | None:
        rewards = _rewards(group, "check_reward_nonzero_std")
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        return "reward_std_zero" if std <= min_std else None

    return check


def check_min_reward(min_reward: float) -> FilterFn:
    """Drop groups in which no sample reaches `min_reward` (max reward < min_reward)."""
    if not math.isfinite(min_reward):
        raise ValueError(f"min_reward must be finite, got {min_reward}")

    def check(group: Sequence[Sample]) -> str | None:
        return "min_reward" if max(_rewards(group, "check_min_reward")) < min_reward else None

    return check


def check_response_diversity(*, min_unique_fraction: float = 0.5) -> FilterFn:
    """Drop groups whose distinct responses (by token ids) are fewer than this fraction of the group."""
    if not 0.0 <= min_unique_fraction <= 1.0:
        raise ValueError(f"min_unique_fraction must be in [0, 1], got {min_unique_fraction}")

    def check(group: Sequence[Sample]) -> str | None:
        unique = len({s.response_tokens for s in group})
        return "low_diversity" if unique < min_unique_fraction * len(group) else None

    return check


def check_reasonable_length(*, min_response_tokens: int = 1, max_truncated_fraction: float = 1.0) -> FilterFn:
    """Drop groups with a response shorter than `min_response_tokens` or too many truncated ones."""
    if min_response_tokens < 0:
        raise ValueError(f"min_response_tokens must be >= 0, got {min_response_tokens}")
    if not 0.0 <= max_truncated_fraction <= 1.0:
        raise ValueError(f"max_truncated_fraction must be in [0, 1], got {max_truncated_fraction}")

    def check(group: Sequence[Sample]) -> str | None:
        if min(s.response_length for s in group) < min_response_tokens:
            return "too_short"
        truncated = sum(s.status == Status.TRUNCATED for s in group)
        return "too_many_truncated" if truncated > max_truncated_fraction * len(group) else None

    return check


def combine_filters(*filters: FilterFn) -> FilterFn:
    """A FilterFn applying `filters` in order; the first reason wins, None if all keep the group."""
    for i, f in enumerate(filters):
        if not callable(f):
            raise TypeError(f"filters[{i}] must be callable, got {type(f).__name__}")

    def check(group: Sequence[Sample]) -> str | None:
        for f in filters:
            reason = f(group)
            if reason is not None:
                return reason
        return None

    return check
