"""An agent's episode as the endpoint records it, and the Samples it becomes.

Each request the agent makes is a Turn: the prompt ids the engine was given, the ids it sampled
(exactly as sampled: never decoded and re-tokenized), their log-probs and weight version. A later
request whose rendered text starts with an earlier turn's prompt and sampled text gets that turn's
ids followed by the ids of the new text only (`next_prompt_ids`): the conversation's tokens are
appended to, never rewritten. Where a chat template rewrites earlier turns (drops earlier reasoning,
say) the rendered text does not start so, the prompt is tokenized whole, and that turn starts a new
piece: the episode becomes one Sample per piece (`episode_samples`), each trained on its own prompt
and sampled ids, rather than one Sample whose earlier tokens differ from what the model saw.

In a Sample the engine's tokens are trained (loss weight 1) and everything the agent or its tools
added between turns is masked (0, log-prob 0.0, weight version None in metadata["version_segments"]).
A turn a weight sync cut short (rl.rollout.partial) was continued by the endpoint under the new
weights before the agent got its answer: its sampled ids carry two versions there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollouts.data.rollout import EPISODE_KEY
from rollouts.loops.rollouts.continued import extend_segments
from rollouts.sync.partial import VERSION_SEGMENTS
from rollouts.types import LogProbs, LossMask, Sample, Status, TokenIds

__all__ = [
    "PIECE_KEY",
    "PIECES_KEY",
    "Turn",
    "cut_segments",
    "episode_samples",
    "extends",
    "next_prompt_ids",
    "turn_seed",
]

PIECE_KEY = "episode_piece"
"""Sample.metadata: which piece of its episode the sample is (0 unless the episode was split)."""
PIECES_KEY = "episode_pieces"
"""Sample.metadata: how many Samples the episode became (1: its chat template is append-only)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One request of an episode, as the engine served it."""

    prompt_ids: tuple[int, ...]
    sampled_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    """One per sampled id; None where the engine returned none."""
    weight_version: int | None
    """The oldest weights any sampled id came from."""
    status: Status
    context_text: str
    """The prompt's text followed by the sampled ids' text (special tokens kept): what a later
    request's rendering must start with to continue this turn's ids."""
    segments: tuple[tuple[int | None, int], ...] | None = None
    """(weight version, length) runs over sampled_ids, for a turn a weight sync cut short and the
    endpoint continued under the new weights (rollouts.sync.partial); None: all of weight_version."""

    @property
    def sampled_segments(self) -> tuple[tuple[int | None, int], ...]:
        """(weight version, length) runs over sampled_ids."""
        if self.segments is not None:
            return self.segments
        return ((self.weight_version, len(self.sampled_ids)),) if self.sampled_ids else ()

    @property
    def context_ids(self) -> tuple[int, ...]:
        """Prompt ids followed by sampled ids."""
        return self.prompt_ids + self.sampled_ids


def next_prompt_ids(previous: Turn | None, text: str, encode: Callable[[str], Sequence[int]]) -> tuple[int, ...]:
    """The prompt ids of rendered `text`: `previous`'s context ids followed by the ids of the rest of
    `text` where `text` starts with `previous.context_text`; `encode(text)` whole otherwise."""
    if previous is not None and text.startswith(previous.context_text):
        return previous.context_ids + tuple(encode(text[len(previous.context_text) :]))
    return tuple(encode(text))


def extends(turn: Turn, prompt_ids: Sequence[int]) -> bool:
    """Whether `prompt_ids` start with `turn`'s prompt and sampled ids (the episode is append-only there)."""
    context = turn.context_ids
    return len(prompt_ids) >= len(context) and tuple(prompt_ids[: len(context)]) == context


def turn_seed(base: int | None, episode: int, turn: int, request_seed: int | None) -> int | None:
    """The sampling seed of an episode's turn: a 63-bit hash of the group's seed, the episode's index
    in its group, the turn's index and the agent's own `seed`, so that episodes and turns differ and
    a seeded run samples the same at any concurrency. None when neither seed is set."""
    if base is None and request_seed is None:
        return None
    digest = hashlib.blake2b(f"{base}:{episode}:{turn}:{request_seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def cut_segments(segments: Sequence[tuple[int | None, int]], length: int) -> tuple[tuple[int | None, int], ...]:
    """(weight version, length) runs over the first `length` ids of those `segments` cover."""
    out: list[tuple[int | None, int]] = []
    for version, n in segments:
        if length > 0:
            out.append((version, min(n, length)))
        length -= n
    return tuple(out)


def pieces(turns: Sequence[Turn]) -> list[list[Turn]]:
    """`turns` in runs where each turn's prompt extends the turn before it."""
    out: list[list[Turn]] = []
    for turn in turns:
        if out and extends(out[-1][-1], turn.prompt_ids):
            out[-1].append(turn)
        else:
            out.append([turn])
    return out


def episode_samples(
    turns: Sequence[Turn],
    *,
    episode_id: str,
    decode: Callable[[Sequence[int]], str],
    metadata: Mapping[str, Any],
) -> list[Sample]:
    """The episode's Samples: one per piece (one in all where every turn extends the one before it).
    Each carries `metadata` and the episode's id (rollouts.data EPISODE_KEY); `decode` gives the
    response text, which is the whole episode's for every piece (a reward scores the episode)."""
    if not turns:
        raise ValueError("an episode with no turns has no tokens to train on")
    runs = pieces(turns)
    first, last = turns[0], turns[-1]
    after = len(first.prompt_ids) if extends_prompt(last, first) else 0
    response = decode(last.context_ids[after:])
    shared = {**metadata, EPISODE_KEY: episode_id, PIECES_KEY: len(runs)}
    return [_piece(run, response, {**shared, PIECE_KEY: i}) for i, run in enumerate(runs)]


def extends_prompt(turn: Turn, first: Turn) -> bool:
    """Whether `turn`'s context starts with `first`'s prompt ids."""
    return turn.context_ids[: len(first.prompt_ids)] == first.prompt_ids


def _piece(run: Sequence[Turn], response: str, metadata: dict[str, Any]) -> Sample:
    """One Sample of a run of turns each extending the one before: prompt = the first turn's."""
    start = at = len(run[0].prompt_ids)
    mask: list[float] = [0.0] * start
    logprobs: list[float] = []
    segments: list[list[Any]] = []
    for turn in run:
        added = len(turn.prompt_ids) - at  # what the agent or its tools appended since the last turn
        n = len(turn.sampled_ids)
        mask += [0.0] * added + [1.0] * n
        logprobs += [0.0] * added + (list(turn.logprobs) if turn.logprobs is not None else [0.0] * n)
        segments = extend_segments(segments, [(None, added), *turn.sampled_segments])
        at = len(turn.prompt_ids) + n
    versions = [t.weight_version for t in run if t.weight_version is not None]
    return Sample(
        tokens=TokenIds(run[-1].context_ids),
        num_prompt_tokens=start,
        loss_mask=LossMask(mask),
        rollout_logprobs=LogProbs(logprobs) if all(t.logprobs is not None for t in run) else None,
        response=response,
        status=run[-1].status,
        weight_version=min(versions) if versions else None,  # the oldest: a staleness bound holds for every token
        metadata={**metadata, VERSION_SEGMENTS: segments, "turns": len(run)},
    )
