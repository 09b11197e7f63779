"""Multi-turn partial rollouts: an episode's turns continued in place across a weight sync.

With rl.rollout.partial a sync pauses the rollout manager and the engine's abort() cuts the
responses in flight short. A single-turn group comes back partial and the manager continues it from
its tokens (functions.group_continuer). An episode (an environment's, a tool rollout's, an agent's)
cannot be continued from its tokens alone: its environment, tools or agent live in the rollout
function. So it keeps going: its rollout function gets a `ContinuingEngine` as `ctx.engine`, and
each engine call goes through the request's `EngineCalls` (rollouts.data.manager_gate): a pause
waits for the calls in flight to come back cut short, never for an episode between turns, and a
call waits for the pause to end before it reaches the engine. A turn cut short is continued from
prompt + the tokens sampled so far with the rest of its max_new_tokens, under the new weights
(rollouts.sync.partial.continue_partials), and comes back to the episode whole: its
metadata["version_segments"] says which weights sampled which tokens, its weight_version is the
oldest. The episode's later turns run under the new weights.

Staleness: the weight version of the oldest token any call of the group sampled goes with each call;
where the pause made it too stale for the step's `max_staleness`, the group's attempt is cancelled
and its prompt generated again (`groups_restarted`), as a partial group too stale to continue is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rollouts.data.manager_gate import EngineCalls
from rollouts.sync.partial import PARTIAL, continue_partials, oldest_version
from rollouts.types import InferenceEngine, Sample, SamplingParams

__all__ = ["ContinuingEngine", "extend_segments", "oldest_of", "refuse_partial_episodes"]

_MAX_CONTINUATIONS = 16  # each one waits out a sync: more in one turn is an engine cutting it short unasked


class ContinuingEngine:
    """`engine` for one attempt at a group of episodes: each call counted through `calls`, and a
    response cut short by a pause continued once the pause is over (module docstring). The other
    InferenceEngine methods pass straight through."""

    def __init__(self, engine: InferenceEngine, calls: EngineCalls) -> None:
        self.inner, self._calls = engine, calls
        self._oldest: int | None = None  # the oldest weight version of any token sampled through it

    @property
    def name(self) -> str:
        return self.inner.name

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Sample]:
        """`params.n` samples per prompt, as the engine's generate, none of them partial."""
        async with self._calls.call(oldest_version=self._oldest):
            samples = list(await self.inner.generate(prompts, params))
        one = dataclasses.replace(params, n=1)  # each cut response is continued on its own
        for _ in range(_MAX_CONTINUATIONS):
            self._oldest = oldest_of([self._oldest, *(oldest_version(s) for s in samples)])
            cut = [i for i, s in enumerate(samples) if s.metadata.get(PARTIAL)]
            if not cut:
                return samples
            async with self._calls.call(oldest_version=self._oldest, continues=True):
                done = await continue_partials(self.inner, [samples[i] for i in cut], one)
            for i, s in zip(cut, done, strict=True):
                samples[i] = s
        raise RuntimeError(
            f"engine {self.name} cut a response short {_MAX_CONTINUATIONS} times in one turn: each cut should "
            "come from a weight sync's pause, and syncs come between steps"
        )

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        await self.inner.update_weights_from_disk(path, weight_version)

    async def weight_version(self) -> int | None:
        return await self.inner.weight_version()

    async def health(self) -> bool:
        return await self.inner.health()


async def refuse_partial_episodes(record: Any, group: Sequence[Sample]) -> list[Sample]:
    """The continue_fn of partial multi-turn rollouts: their episodes are continued in place, so a
    group coming back partial made an engine call around the ContinuingEngine."""
    raise ValueError(
        "a multi-turn rollout returned partial samples: with rl.rollout.partial its engine calls must go "
        "through ctx.engine (which continues a turn cut short by a sync), not another engine"
    )


def oldest_of(versions: Sequence[int | None]) -> int | None:
    """The smallest of the known `versions` (None where none is)."""
    known = [v for v in versions if v is not None]
    return min(known) if known else None


def extend_segments(segments: Sequence[Sequence[Any]], more: Sequence[tuple[int | None, int]]) -> list[list[Any]]:
    """Version segments ([weight_version, length] runs, rollouts.sync.partial) followed by `more`,
    runs of one version next to each other merged and empty ones left out: an episode's response
    is its turns' runs with its observations' (None: no weights sampled them) in between."""
    out = [list(s) for s in segments]
    for version, length in more:
        if length and out and out[-1][0] == version:
            out[-1][1] += length
        elif length:
            out.append([version, length])
    return out
