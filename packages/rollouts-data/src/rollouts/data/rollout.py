"""Rollout generation as pure functions: grouping, rewards and filters, batches and their statistics.

Legend: G samples per prompt (a group), P prompts (groups) in a step.

The driver (concurrent, with retries, timeouts and dynamic sampling) is `AsyncRolloutManager`,
built from the functions here; a loop with its own driver composes them the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollouts.types import FilterFn, RewardFn, RolloutBatch, Sample, Status

__all__ = [
    "EPISODE_KEY",
    "Transformed",
    "apply_sample_transforms",
    "assign_groups",
    "batch_metadata",
    "convert_to_batch",
    "group_samples",
    "is_partial",
    "num_episodes",
    "validate_group",
]

EPISODE_KEY = "episode_id"
"""Sample.metadata: the episode a sample is a piece of. A group holds one episode per response; an
episode may be several Samples (an agent episode split where its chat template rewrote earlier
turns), which share this id. A sample without it is an episode of its own."""


def num_episodes(group: Sequence[Sample]) -> int:
    """How many episodes `group` holds (EPISODE_KEY)."""
    ids = {s.metadata.get(EPISODE_KEY, ("sample", i)) for i, s in enumerate(group)}
    return len(ids)


def is_partial(sample: Sample) -> bool:
    """Whether `sample` is a partial response cut short by an abort, to be continued (status ABORTED
    and metadata["partial"] set: the convention of rollouts.sync.partial and the in-process sampler)."""
    return sample.status is Status.ABORTED and bool(sample.metadata.get("partial"))


def validate_group(result: Any, n: int, *, prompt: Any, allow_partial: bool = False) -> tuple[Sample, ...]:
    """Check a generate function's output: Samples of exactly `n` episodes (`num_episodes`: one
    Sample each, unless split), none failed or aborted (with
    `allow_partial`, aborted ones may be partial responses, `is_partial`)."""
    if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Sequence):
        raise TypeError(
            f"generate_fn must return a sequence of {n} Samples, got {type(result).__name__} for prompt {prompt!r:.80}"
        )
    group = tuple(result)
    for i, s in enumerate(group):
        if not isinstance(s, Sample):
            raise TypeError(f"generate_fn returned {type(s).__name__} at position {i}, expected Sample")
    if num_episodes(group) != n:
        raise ValueError(
            f"generate_fn returned {num_episodes(group)} episodes ({len(group)} samples) for prompt {prompt!r:.80}, "
            f"expected {n} (one group)"
        )
    for i, s in enumerate(group):
        if s.status in (Status.FAILED, Status.ABORTED, Status.PENDING) and not (allow_partial and is_partial(s)):
            raise ValueError(f"generate_fn returned a sample with status {s.status.value!r} at position {i}")
    return group


def assign_groups(groups: Sequence[Sequence[Sample]]) -> tuple[tuple[Sample, ...], ...]:
    """The groups with group_index g set on group g and index set to the position in the flattened step."""
    out, position = [], 0
    for g, group in enumerate(groups):
        out.append(tuple(s.replace(group_index=g, index=position + i) for i, s in enumerate(group)))
        position += len(group)
    return tuple(out)


def group_samples(samples: Sequence[Sample]) -> tuple[tuple[Sample, ...], ...]:
    """Samples grouped by group_index, groups in order of first appearance."""
    groups: dict[int, list[Sample]] = {}
    for i, s in enumerate(samples):
        if s.group_index is None:
            raise ValueError(f"samples[{i}].group_index is None: assign groups before grouping")
        groups.setdefault(s.group_index, []).append(s)
    return tuple(tuple(g) for g in groups.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class Transformed:
    """Groups after rewards and the filter: the kept ones and the dropped ones with reasons."""

    kept: tuple[tuple[Sample, ...], ...]
    """Groups the filter kept (samples rewarded)."""
    filtered: tuple[tuple[str, tuple[Sample, ...]], ...]
    """(reason, group) for every dropped group."""

    @property
    def num_filtered(self) -> int:
        """Samples in dropped groups."""
        return sum(len(g) for _, g in self.filtered)

    @property
    def filter_reasons(self) -> dict[str, int]:
        """Reason -> number of samples dropped for it."""
        out: dict[str, int] = {}
        for reason, g in self.filtered:
            out[reason] = out.get(reason, 0) + len(g)
        return out


def apply_sample_transforms(
    groups: Sequence[Sequence[Sample]],
    *,
    reward_fn: RewardFn | None = None,
    filter_fn: FilterFn | None = None,
    records: Sequence[Any] | None = None,
) -> Transformed:
    """Score samples without a reward with `reward_fn(sample, record)` (a sync RewardFn; `records`:
    each group's prompt record, None for each when not given), then keep or drop each group by
    `filter_fn`."""
    if records is not None and len(records) != len(groups):
        raise ValueError(f"records must hold one prompt record per group: {len(records)} for {len(groups)} groups")
    kept, filtered = [], []
    for i, group in enumerate(groups):
        group = tuple(group)
        if reward_fn is not None:
            record = None if records is None else records[i]
            group = tuple(s if s.reward is not None else s.with_reward(_score(reward_fn, s, record)) for s in group)
        reason = filter_fn(group) if filter_fn is not None else None
        if reason is None:
            kept.append(group)
        elif isinstance(reason, str) and reason:
            filtered.append((reason, group))
        else:
            raise TypeError(f"filter_fn must return None or a non-empty reason string, got {reason!r}")
    return Transformed(kept=tuple(kept), filtered=tuple(filtered))


def _score(reward_fn: RewardFn, sample: Sample, record: Any) -> float:
    reward = reward_fn(sample, record)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"reward_fn must return a finite float, got {reward!r} for response {sample.response!r:.80}")
    return float(reward)


def batch_metadata(samples: Sequence[Sample]) -> dict[str, float]:
    """Statistics of a step's samples: counts, reward and response-length stats, truncation rate."""
    out: dict[str, float] = {
        "num_samples": float(len(samples)),
        "num_groups": float(len({s.group_index for s in samples})),
        "num_loss_tokens": float(sum(s.num_loss_tokens for s in samples)),
    }
    if not samples:
        return out
    lengths = [s.response_length for s in samples]
    out |= {
        "response_length_mean": sum(lengths) / len(lengths),
        "response_length_min": float(min(lengths)),
        "response_length_max": float(max(lengths)),
        "truncation_rate": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
    }
    rewards = [s.reward for s in samples if s.reward is not None]
    if rewards:
        mean = sum(rewards) / len(rewards)
        out |= {
            "reward_mean": mean,
            "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
            "reward_min": min(rewards),
            "reward_max": max(rewards),
        }
    return out


def convert_to_batch(
    samples: Sequence[Sample],
    *,
    epoch: int,
    step: int,
    num_filtered: int = 0,
    num_failed: int = 0,
    num_carried_over: int = 0,
    filter_reasons: Mapping[str, int] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> RolloutBatch:
    """A RolloutBatch of `samples` with batch_metadata (plus `metadata`) attached."""
    return RolloutBatch(
        samples=tuple(samples),
        epoch=epoch,
        step=step,
        num_filtered=num_filtered,
        num_failed=num_failed,
        num_carried_over=num_carried_over,
        filter_reasons=dict(filter_reasons or {}),
        metadata={**batch_metadata(samples), **(metadata or {})},
    )
