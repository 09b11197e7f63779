"""One RL step on a batch of scored rollouts, as every rank runs it: overlong penalty, staleness
filter, the policy update, and the step's rollout metrics. `rl.py` drives it once per step; a user's
own loop can call `rl_step` directly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from rollouts.backends import TrainingComponents
from rollouts.loops.rl.per_token import AdvantageFn
from rollouts.loops.rl.update import rl_update
from rollouts.loops.rollouts.scoring import reward_errors, summarize
from rollouts.loops.run.distributed import rank_world
from rollouts.losses import LossFn, overlong_penalty
from rollouts.types import AlgorithmConfig, RLConfig, RolloutBatch, Sample, Status, TrainingState

log = logging.getLogger(__name__)


def with_overlong_penalty(
    samples: Sequence[Sample], algorithm: AlgorithmConfig, *, max_new_tokens: int
) -> list[Sample]:
    """DAPO soft overlong punishment added to each reward (no-op when overlong_buffer_length is 0)."""
    if algorithm.overlong_buffer_length == 0:
        return list(samples)
    buffer = min(algorithm.overlong_buffer_length, max_new_tokens)
    return [
        s.with_reward(
            (s.reward or 0.0)
            + overlong_penalty(
                s.response_length,
                max_length=max_new_tokens,
                buffer_length=buffer,
                factor=algorithm.overlong_penalty_factor,
            )
        )
        for s in samples
    ]


def rollout_metrics(batch: RolloutBatch, state: TrainingState) -> dict[str, float]:
    """Reward, length, truncation, staleness and accounting figures of one step's rollouts."""
    samples = batch.samples
    rewards = [s.reward or 0.0 for s in samples]
    lengths = [s.response_length for s in samples]
    staleness = [state.weight_version - s.weight_version for s in samples if s.weight_version is not None]

    def mean(values: Sequence[float]) -> float:
        return float(np.mean(values)) if values else math.nan

    out = {
        "reward_mean": mean(rewards),
        "reward_std": float(np.std(rewards)) if rewards else math.nan,
        "accuracy": mean([r > 0 for r in rewards]),
        "response_length_mean": mean(lengths),
        "response_length_max": float(max(lengths, default=0)),
        "truncated_fraction": mean([s.status is Status.TRUNCATED for s in samples]),
        "staleness_max": float(max(staleness, default=0)),
        "num_samples": float(len(samples)),
        "num_filtered": float(batch.num_filtered),
        "num_failed": float(batch.num_failed),
        "num_carried_over": float(batch.num_carried_over),
        "num_reward_errors": float(len(reward_errors(samples))),
    }
    for key in ("groups_requested", "groups_partial", "groups_restarted", "num_rounds", "generate_s"):
        if key in batch.metadata:
            out[key] = float(batch.metadata[key])
    return out


def rl_step(
    components: TrainingComponents,
    state: TrainingState,
    batch: RolloutBatch,
    config: RLConfig,
    *,
    ref_components: TrainingComponents | None = None,
    advantage_fn: AdvantageFn | None = None,
    loss_fn: LossFn | None = None,
    critic: TrainingComponents | None = None,
) -> tuple[TrainingState, dict[str, float]]:
    """Train on one step's rollouts: overlong penalty, staleness filter, update; (state, metrics).
    `critic`: PPO's value model (GAE), updated with the policy.

    Under torchrun every rank calls it with the same batch. A batch with no fresh sample leaves
    the state as it is (metrics say why).
    """
    check_logprobs_distribution(batch.samples, config)
    samples = with_overlong_penalty(
        batch.samples, config.algorithm, max_new_tokens=config.rollout.sampling.max_new_tokens
    )
    fresh = [
        s
        for s in samples
        if s.weight_version is None or state.weight_version - s.weight_version <= config.max_staleness
    ]
    metrics = rollout_metrics(batch, state)
    metrics["num_too_stale"] = float(len(samples) - len(fresh))
    metrics["num_trained"] = float(len(fresh))
    causes = failure_causes(batch)
    if causes:  # text in the JSONL record: what failed this step, most common first
        metrics["failure_causes"] = summarize(causes)  # type: ignore[assignment]
    if fresh:
        state, train_metrics = rl_update(
            components,
            state,
            fresh,
            config,
            ref_components=ref_components,
            advantage_fn=advantage_fn,
            loss_fn=loss_fn,
            critic=critic,
        )
        metrics.update(train_metrics)
    return state, metrics


def check_logprobs_distribution(samples: Sequence[Sample], config: RLConfig) -> None:
    """Refuse rollout log-probs of another distribution than the trainer's when the loss uses them.

    The trainer computes log-probs of the distribution sampled from (temperature, top-k, top-p).
    Samples whose metadata["logprobs_of"] is "model" (an engine reporting the full softmax: vLLM's
    default raw_logprobs) describe another one whenever sampling changes it; importance weights
    against them would be biased, so that is an error naming the fix.
    """
    sampling, algorithm = config.rollout.sampling, config.effective_algorithm
    changes_dist = sampling.temperature not in (0.0, 1.0) or 0 < sampling.top_k or sampling.top_p < 1.0
    if not changes_dist or not (algorithm.is_cap is not None or algorithm.needs_rollout_logprobs):
        return
    raw = [s for s in samples if s.metadata.get("logprobs_of") == "model"]
    if raw:
        raise ValueError(
            f"{len(raw)} samples carry log-probs of the model's full softmax, but they were sampled at "
            f"temperature={sampling.temperature}, top_k={sampling.top_k}, top_p={sampling.top_p} and the loss "
            "weighs them against the trainer's log-probs of that sampling distribution: start vLLM with "
            "--logprobs-mode processed_logprobs (rollouts engine vllm does) and give VLLMEngine that logprobs_mode"
        )


def failure_causes(batch: RolloutBatch) -> list[str]:
    """Every generation error (engine, URL, status, message as the engine client reported it) and
    reward error of a step's batch."""
    return [str(e) for e in batch.metadata.get("errors", ())] + reward_errors(batch.samples)


def log_completions(batch: RolloutBatch, step: int, num: int) -> None:
    """A few of the step's completions at INFO level (rank 0): prompt, response and reward."""
    if rank_world()[0] != 0:
        return
    for sample in batch.samples[:num]:
        log.info(
            "step %d completion: prompt=%.200r response=%.300r reward=%s",
            step,
            sample.prompt,
            sample.response,
            sample.reward,
        )
