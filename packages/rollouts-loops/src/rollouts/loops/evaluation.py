"""Held-out evaluation through any InferenceEngine: mean reward, pass@1, pass@k and maj@k.

k = samples per prompt. pass@k is the unbiased estimator of Chen et al. (2021) from n samples of
which c are correct, 1 - C(n-c, k) / C(n, k), here with n = k; maj@k scores the most common
response of the k (ties: the first seen) as correct when that response is.

Correct (`is_correct`): the sample's metadata["correct"] when a rollout function or environment set
it, otherwise reward >= `min_reward` (RLConfig.correct_min_reward, `rl.correct_min_reward` in a run
file; 1.0 by default, the reward of a right answer from the built-in rewards). Partial credit below
it, such as 0.2 for any well-formed number, counts in eval_reward_mean but not as correct.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from rollouts.loops.rollouts.functions import PromptEncoder, record_metadata
from rollouts.loops.rollouts.scoring import GroupScorer, Reward
from rollouts.types import InferenceEngine, Sample, SamplingParams

_EVAL_CHUNK_PROMPTS = 256  # prompts per generate call: bounds memory of the in-process sampler
CORRECT_KEY = "correct"
"""Sample.metadata key of an explicit verdict (bool) that overrides the reward threshold."""


def is_correct(sample: Sample, *, min_reward: float = 1.0) -> bool:
    """metadata["correct"] when set, otherwise whether the sample's reward is >= `min_reward`."""
    flag = sample.metadata.get(CORRECT_KEY)
    if flag is not None:
        if not isinstance(flag, bool):
            raise TypeError(f"Sample.metadata[{CORRECT_KEY!r}] must be a bool, got {flag!r}")
        return flag
    return sample.reward is not None and sample.reward >= min_reward


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c of them correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_correct(samples: Sequence[Sample], *, min_reward: float = 1.0) -> bool:
    """Whether the most common response (stripped; ties: first seen) of a group is correct
    (`is_correct` of its first occurrence)."""
    if not samples:
        raise ValueError("majority_correct needs at least one sample")
    counts = Counter(s.response.strip() for s in samples)
    top = max(counts.values())
    winner = next(s for s in samples if counts[s.response.strip()] == top)
    return is_correct(winner, min_reward=min_reward)


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluation:
    """What to evaluate during a run, and how often."""

    records: tuple[Mapping[str, Any], ...]
    every_steps: int
    """Evaluate after every this many optimizer steps (and after the last)."""
    sampling: SamplingParams
    """Sampling for evaluation; `n` is k (1: greedy pass@1 with temperature 0)."""
    stop_on_error: bool = False
    """An evaluation that fails (the engine errs, a reward raises) stops the run, after the step's
    metrics and checkpoint are written; False: it is logged and counted (eval_failed) and the run goes on."""
    correct_min_reward: float = 1.0
    """The reward at or above which a response counts as correct (`is_correct`)."""

    def __post_init__(self) -> None:
        if not self.records:
            raise ValueError("Evaluation.records is empty: nothing to evaluate on")
        if self.every_steps < 1:
            raise ValueError(f"Evaluation.every_steps must be >= 1, got {self.every_steps}")


def group_metrics(
    groups: Sequence[Sequence[Sample]], *, prefix: str = "eval_", min_reward: float = 1.0
) -> dict[str, float]:
    """Mean reward, pass@1, pass@k and maj@k (k = group size) over scored groups; correct is
    `is_correct(sample, min_reward=min_reward)`."""
    k = len(groups[0])
    correct = [sum(is_correct(s, min_reward=min_reward) for s in g) for g in groups]
    out = {
        f"{prefix}reward_mean": sum(s.reward or 0.0 for g in groups for s in g) / (k * len(groups)),
        f"{prefix}pass@1": sum(pass_at_k(k, c, 1) for c in correct) / len(groups),
    }
    if k > 1:
        out[f"{prefix}pass@{k}"] = sum(pass_at_k(k, c, k) for c in correct) / len(groups)
        out[f"{prefix}maj@{k}"] = sum(majority_correct(g, min_reward=min_reward) for g in groups) / len(groups)
    return out


async def evaluate_groups(
    engine: InferenceEngine,
    records: Sequence[Mapping[str, Any]],
    encode_prompt: PromptEncoder,
    reward: Reward,
    params: SamplingParams,
) -> list[list[Sample]]:
    """`params.n` scored responses per record (reward errors score 0)."""
    if not records:
        raise ValueError("evaluate needs at least one record")
    scorer = GroupScorer(dataclasses.replace(reward, on_error="zero"))
    groups: list[list[Sample]] = []
    for start in range(0, len(records), _EVAL_CHUNK_PROMPTS):
        chunk = records[start : start + _EVAL_CHUNK_PROMPTS]
        samples = await engine.generate([list(encode_prompt(r)) for r in chunk], params)
        for i, record in enumerate(chunk):
            group = [s.with_metadata(**record_metadata(record)) for s in samples[i * params.n : (i + 1) * params.n]]
            groups.append(await scorer.score(group, record))
    return groups


async def evaluate_async(
    engine: InferenceEngine,
    records: Sequence[Mapping[str, Any]],
    encode_prompt: PromptEncoder,
    reward: Any,
    params: SamplingParams,
) -> tuple[float, list[Sample]]:
    """(mean reward, scored samples) of one response per record; `reward(sample, record)` or a Reward."""
    groups = await evaluate_groups(engine, records, encode_prompt, Reward.of(reward), dataclasses.replace(params, n=1))
    scored = [g[0] for g in groups]
    return sum(s.reward or 0.0 for s in scored) / len(scored), scored


def evaluate(
    engine: InferenceEngine,
    records: Sequence[Mapping[str, Any]],
    encode_prompt: PromptEncoder,
    reward: Any,
    params: SamplingParams,
) -> tuple[float, list[Sample]]:
    """Synchronous `evaluate_async` (runs its own trio loop)."""
    return trio.run(evaluate_async, engine, records, encode_prompt, reward, params)
