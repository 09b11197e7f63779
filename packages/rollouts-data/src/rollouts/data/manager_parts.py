"""The rollout manager's parts that hold no state of its own: per-request seeds, whether a
generate function takes one, the first-N tail of a round, and a saved partial group checked (rollouts.data.manager)."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping
from typing import Any

import anyio

from rollouts.data.rollout import Transformed, is_partial
from rollouts.types import Sample

__all__ = ["FirstN", "partial_group_of", "request_seed", "takes_seed"]


def request_seed(seed: int, position: int) -> int:
    """The sampling seed of the prompt at `position` in the data stream (epoch * num_prompts + index
    within the epoch) of a run seeded with `seed`: a 63-bit hash, so neighbouring positions and
    seeds give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def takes_seed(fn: Any) -> bool:
    """Whether `fn` accepts a `seed` keyword (explicitly, or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "seed" and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
        for p in params
    )


class FirstN:
    """tail="first_n": scores each group as it arrives (scoring is per group, so the same as after
    the round) and cancels the round once `room` groups are kept; a scoring error ends the round
    and is raised after it, as it would be without first_n."""

    def __init__(self, room: int, scope: anyio.CancelScope, transform: Any) -> None:
        self.room, self.scope, self.transform = room, scope, transform
        self.num_kept = 0
        self.error: Exception | None = None
        self.outs: dict[int, Transformed] = {}  # request id -> its scored, filtered group

    def on_group(self, results: dict[int, Any]) -> Any:
        def done(rid: int) -> None:
            try:
                self.outs[rid] = self.transform([results[rid]])
                self.num_kept += len(self.outs[rid].kept)
            except Exception as e:  # raised by generate_batch once the round is over
                self.error = self.error or e
                self.scope.cancel()
            if self.num_kept >= self.room:
                self.scope.cancel()

        return done


def partial_group_of(i: int, saved: Any, expected: int) -> tuple[int | None, Any, tuple[Sample, ...]]:
    """partial_groups[i] of a saved state, checked: a mapping of position, prompt and `expected`
    samples, at least one of them partial."""
    if not isinstance(saved, Mapping) or set(saved) != {"position", "prompt", "samples"}:
        raise ValueError(f"partial_groups[{i}] must be a mapping of position, prompt and samples, got {saved!r:.120}")
    position = saved["position"]
    if position is not None and (not isinstance(position, int) or isinstance(position, bool)):
        raise ValueError(f"partial_groups[{i}].position must be an int or None, got {position!r}")
    group = tuple(Sample.from_dict(d) for d in saved["samples"])
    if len(group) != expected or not any(is_partial(s) for s in group):
        raise ValueError(
            f"partial_groups[{i}] must hold samples_per_prompt={expected} samples, at least one partial; "
            f"got {len(group)} ({sum(is_partial(s) for s in group)} partial)"
        )
    return position, saved["prompt"], group
