"""The rollout manager's parts that hold no state of its own: per-request seeds, whether a
generate function takes one, the first-N tail of a round, the staleness of a partial group, and
its saved state written and checked (rollouts.data.manager)."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from rollouts.data.rollout import Transformed, is_partial, num_episodes
from rollouts.types import Sample, thaw

__all__ = [
    "FirstN",
    "count_causes",
    "dump_state",
    "parse_state",
    "request_seed",
    "takes_engine_calls",
    "takes_seed",
    "too_stale",
]


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


def takes_engine_calls(fn: Any) -> bool:
    """Whether `fn` names an `engine_calls` keyword (explicitly: a function taking **kwargs does not
    say it counts its engine calls, and a pause must wait for it whole)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return False
    param = params.get("engine_calls")
    return param is not None and param.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def count_causes(causes: Mapping[str, int], failures: Sequence[str], *, last: str, max_causes: int) -> dict[str, int]:
    """`causes` (error -> failed requests) with `failures` counted in by the error each failed with
    last (the text after `last`: its prompt left out, so that one cause failing many prompts is one
    count); at most `max_causes` causes, each cut to 200 characters."""
    out = dict(causes)
    for failure in failures:
        cause = failure.split(last, 1)[-1][:200]
        if cause in out or len(out) < max_causes:
            out[cause] = out.get(cause, 0) + 1
    return out


def too_stale(group: tuple[Sample, ...], train_version: int | None, max_staleness: int | None) -> bool:
    """Whether continuing `group` makes samples more than `max_staleness` versions behind
    `train_version` (False where either is None, or no sample's version is known). A sample's
    weight_version is its oldest token's (rollouts.sync.partial) and continuing adds only newer
    tokens, so the group's oldest version now is its samples' oldest once continued."""
    if max_staleness is None or train_version is None:
        return False
    known = [s.weight_version for s in group if s.weight_version is not None]
    return bool(known) and train_version - min(known) > max_staleness


class FirstN:
    """tail="first_n": scores each group as it arrives (scoring is per group, so the same as after
    the round) and ends the round once `room` groups are kept: with `cut` (partial rollouts) by
    calling it (the engine's abort: the running requests come back partial, to be continued),
    otherwise by cancelling the round. A scoring error ends the round and is raised after it, as
    it would be without first_n. Groups holding partial samples are left to the round's end."""

    def __init__(
        self, room: int, scope: anyio.CancelScope, transform: Any, cut: Callable[[], object] | None = None
    ) -> None:
        self.room, self.scope, self.transform, self.cut = room, scope, transform, cut
        self.num_kept = 0
        self.error: Exception | None = None
        self.outs: dict[int, Transformed] = {}  # request id -> its scored, filtered group
        self.was_cut = False

    def on_group(self, results: dict[int, Any]) -> Any:
        def done(rid: int) -> None:
            if any(is_partial(s) for s in results[rid]):
                return
            try:
                self.outs[rid] = self.transform(rid, results[rid])
                self.num_kept += len(self.outs[rid].kept)
            except Exception as e:  # raised by generate_batch once the round is over
                self.error = self.error or e
                self.scope.cancel()
            if self.num_kept >= self.room and not self.was_cut:
                if self.cut is None:
                    self.scope.cancel()
                else:
                    self.was_cut = True
                    self.cut()

        return done


def _partial_group_of(i: int, saved: Any, expected: int) -> tuple[int | None, Any, tuple[Sample, ...]]:
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


def parse_state(
    state: Mapping[str, Any], expected: int
) -> tuple[
    list[tuple[int | None, Any, tuple[Sample, ...]]],
    list[tuple[int | None, Any]],
    list[tuple[int | None, Any, tuple[Sample, ...]]],
]:
    """A saved manager state, checked: ((position, prompt, group) of carry-over groups, (position,
    prompt) of pending prompts, (position, prompt, group) of partial groups), each group of
    `expected` samples; a carried group's prompt is None where the state does not hold it."""
    keys, required = set(state), {"carry_over", "pending_prompts"}
    optional = {"pending_positions", "partial_groups", "carry_over_prompts", "carry_over_positions"}
    if not required <= keys <= required | optional:
        raise ValueError(f"manager state keys must be {sorted(required | optional)}, got {sorted(state)}")
    groups = [tuple(Sample.from_dict(d) for d in g) for g in state["carry_over"]]
    for i, g in enumerate(groups):
        if num_episodes(g) != expected:
            raise ValueError(f"carry_over[{i}] has {num_episodes(g)} episodes, expected samples_per_prompt={expected}")
    carry_prompts = list(state.get("carry_over_prompts", [None] * len(groups)))  # None: not known (older states)
    carry_positions = list(state.get("carry_over_positions", [None] * len(groups)))
    if len(carry_prompts) != len(groups) or len(carry_positions) != len(groups):
        raise ValueError(
            f"carry_over_prompts and carry_over_positions must have {len(groups)} entries (one per carried group), "
            f"got {len(carry_prompts)} and {len(carry_positions)}"
        )
    carry = list(zip(carry_positions, carry_prompts, groups, strict=True))
    prompts = list(state["pending_prompts"])
    positions = list(state.get("pending_positions", [None] * len(prompts)))
    if len(positions) != len(prompts) or not all(p is None or isinstance(p, int) for p in positions):
        raise ValueError(
            f"pending_positions must be {len(prompts)} ints (one per pending prompt), got {positions!r:.120}"
        )
    partial = [_partial_group_of(i, d, expected) for i, d in enumerate(state.get("partial_groups", []))]
    return carry, list(zip(positions, prompts, strict=True)), partial


def dump_state(
    carry: list[tuple[int | None, Any, tuple[Sample, ...]]],
    pending: list[tuple[int | None, Any]],
    partial: list[tuple[int | None, Any, tuple[Sample, ...]]],
) -> dict[str, Any]:
    """The manager's state as JSON-ready data (what `parse_state` reads back)."""
    return {
        "carry_over": [[s.to_dict() for s in g] for _, _, g in carry],
        "carry_over_prompts": [thaw(p) for _, p, _ in carry],
        "carry_over_positions": [pos for pos, _, _ in carry],
        "pending_prompts": [thaw(p) for _, p in pending],
        "pending_positions": [pos for pos, _ in pending],
        "partial_groups": [
            {"position": pos, "prompt": thaw(p), "samples": [s.to_dict() for s in g]} for pos, p, g in partial
        ],
    }
