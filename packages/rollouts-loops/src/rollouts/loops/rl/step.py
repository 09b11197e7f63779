"""One RL step on a batch of scored rollouts, as every rank runs it: overlong penalty, staleness
filter and the step's rollout metrics (`rl_step`), then the update (`rl_update`): per-token
advantages, old and reference log-probs, and `num_updates_per_batch` optimizer steps. The loop
(loop.py) drives it once per batch; a user's own loop can call `rl_step` directly. The per-token
glue between samples and micro-batches (advantages, scatter, gathering across ranks) is micro_batches.py.

Legend: N samples in the step, T tokens of one sample (T_i for sample i), B rows and T_row tokens
of a micro-batch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from rollouts.backends import (
    DISTILL_DIVERGENCE_METRIC,
    TrainingComponents,
    compute_logprobs,
    forward_backward,
    optim_step,
)
from rollouts.backends.train.value import compute_values, critic_forward_backward
from rollouts.data import unpack_values
from rollouts.data.rollout import EPISODE_KEY
from rollouts.loops.agents.episode import PIECES_KEY
from rollouts.loops.evaluation import is_correct
from rollouts.loops.micro_batches import (
    AdvantageFn,
    gae_token_advantages,
    gather_per_sample,
    plan_shard,
    scatter_token_values,
    token_advantages,
    whole_batch,
    with_arrays,
)
from rollouts.loops.rl.distill import Distillation, distill_advantages
from rollouts.loops.rollouts.scoring import reward_errors, summarize
from rollouts.loops.run.distributed import global_sum, rank_world
from rollouts.losses import LossFn, kl_penalty, loss_fn_from_config, overlong_penalty
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


def rollout_metrics(batch: RolloutBatch, state: TrainingState, *, min_reward: float = 1.0) -> dict[str, float]:
    """Reward, length, truncation, staleness and accounting figures of one step's rollouts;
    `accuracy` is the fraction `is_correct` at `min_reward` (RLConfig.correct_min_reward)."""
    samples = batch.samples
    rewards = [s.reward or 0.0 for s in samples]
    lengths = [s.response_length for s in samples]
    staleness = [state.weight_version - s.weight_version for s in samples if s.weight_version is not None]

    def mean(values: Sequence[float]) -> float:
        return float(np.mean(values)) if values else math.nan

    out = {
        "reward_mean": mean(rewards),
        "reward_std": float(np.std(rewards)) if rewards else math.nan,
        "accuracy": mean([is_correct(s, min_reward=min_reward) for s in samples]),
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
    episodes = {s.metadata[EPISODE_KEY]: s.metadata.get(PIECES_KEY, 1) for s in samples if EPISODE_KEY in s.metadata}
    if episodes:  # agent episodes: how many were split where their chat template rewrote earlier turns
        out["num_split_episodes"] = float(sum(pieces > 1 for pieces in episodes.values()))
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
    distill: Distillation | None = None,
) -> tuple[TrainingState, dict[str, float]]:
    """Train on one step's rollouts: overlong penalty, staleness filter, update; (state, metrics).
    `critic`: PPO's value model (GAE), updated with the policy. `distill`: a teacher whose per-token
    log-probs give (or add to) the advantages (rollouts.loops.rl.distill).

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
    metrics = rollout_metrics(batch, state, min_reward=config.correct_min_reward)
    if config.algorithm.overlong_buffer_length:  # the penalty apart: reward_mean is the task's reward alone
        penalties = [(s.reward or 0.0) - (b.reward or 0.0) for s, b in zip(samples, batch.samples, strict=True)]
        metrics["overlong_penalty_mean"] = sum(penalties) / max(len(penalties), 1)
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
            distill=distill,
        )
        metrics.update(train_metrics)
    return state, metrics


def default_loss_fn(config: RLConfig) -> LossFn:
    """The configured loss; Dr.GRPO's norm constant defaults to the longest possible response.

    (A constant that is the same in every micro-batch and step: each micro-batch's padded length
    would make the gradient depend on how the step was split.)
    With overlap, `config.effective_algorithm` adds the truncated importance weights of
    RLConfig.overlap_is_cap unless the algorithm sets its own is_cap.
    """
    algorithm = config.effective_algorithm
    if algorithm.loss_aggregation == "seq-mean-token-sum-norm" and algorithm.norm_constant is None:
        algorithm = dataclasses.replace(algorithm, norm_constant=float(config.rollout.sampling.max_new_tokens))
    return loss_fn_from_config(algorithm)


def rl_update(
    components: TrainingComponents,
    state: TrainingState,
    samples: Sequence[Sample],
    config: RLConfig,
    *,
    ref_components: TrainingComponents | None = None,
    advantage_fn: AdvantageFn | None = None,
    loss_fn: LossFn | None = None,
    critic: TrainingComponents | None = None,
    distill: Distillation | None = None,
) -> tuple[TrainingState, dict[str, float]]:
    """Advantages, log-probs and `num_updates_per_batch` optimizer steps on one batch of samples.
    With `distill`, each trained token's advantage is (or gains) coef * (teacher - student log-prob).

    With GAE (PPO with a critic) the critic's values give the advantages and returns, and after the
    policy's steps the critic takes as many, on the clipped value loss (RLConfig.critic).

    Under torchrun every rank calls it with the same samples and trains its share,
    samples[rank::world]. Log-probs (old, reference) are computed for the share on its rank; the
    advantages, which may need the whole batch (group statistics with KL in the reward,
    REINFORCE++'s batch whitening), come from every rank's per-token masks and KL, gathered as
    tensors, so each rank computes exactly what one process would.
    """
    algorithm = config.effective_algorithm
    rank, world = rank_world()
    shard = plan_shard(components, samples, max_tokens_per_micro_batch=config.max_tokens_per_micro_batch)
    real = shard.micro_batches[: shard.num_real]
    mbs = list(shard.micro_batches)
    masks = unpack_values(real, [mb.loss_mask for mb in real])
    metrics: dict[str, float] = {}
    sampled_distill = distill is not None and distill.estimate == "sampled"
    need_old = algorithm.num_updates_per_batch > 1 or algorithm.kl_placement == "reward" or sampled_distill
    # The policy trained is the one sampled from: logits / sampling temperature, truncated by top-k
    # and top-p and renormalised, as the engine drew from it (temperature 0, greedy: the plain softmax).
    sampling = config.rollout.sampling
    temperature = sampling.temperature or 1.0
    top_k, top_p = (sampling.top_k, sampling.top_p) if sampling.temperature else (-1, 1.0)  # -1, 1.0: no truncation
    old = compute_logprobs(components, mbs, temperature=temperature, top_k=top_k, top_p=top_p) if need_old else None
    if old is not None and algorithm.num_updates_per_batch > 1:
        mbs = with_arrays(mbs, "old_logprobs", old)
    kl_local = None
    if algorithm.needs_reference:
        if ref_components is None:
            raise ValueError("the algorithm puts a KL term in the loss or reward but no reference model was given")
        ref = compute_logprobs(ref_components, mbs, temperature=temperature, top_k=top_k, top_p=top_p)
        mbs = with_arrays(mbs, "ref_logprobs", ref)
        if algorithm.kl_placement == "reward":
            assert old is not None
            kl_mbs = [
                kl_penalty(torch.from_numpy(o), torch.from_numpy(r), kind=algorithm.kl_kind).numpy()
                for o, r in zip(old[: shard.num_real], ref[: shard.num_real], strict=True)
            ]
            kl_local = unpack_values(real, kl_mbs)
    all_masks, all_kl = whole_batch(masks, kl_local, num_local=len(shard.local))
    if all_kl is not None:
        kl_sum = sum(float((all_kl[i] * (all_masks[i] > 0)).sum()) for i in all_masks)
        metrics["kl_reward"] = kl_sum / max(1, shard.num_tokens)
    mine = range(len(shard.local))
    if algorithm.advantage_estimator == "gae":
        if critic is None:
            raise ValueError("GAE advantages need a critic: pass critic (rollouts.backends.build_critic)")
        old_values = compute_values(critic, mbs)
        values_local = unpack_values(real, old_values[: shard.num_real])
        (all_values,) = gather_per_sample([values_local], num_local=len(shard.local))
        advantages, returns = gae_token_advantages(samples, algorithm, masks=all_masks, values=all_values, kl=all_kl)
        mbs = with_arrays(mbs, "old_values", old_values)
        mbs = scatter_token_values(mbs, "returns", {i: returns[rank + i * world] for i in mine})
        metrics["value_mean"] = sum(float((v * (all_masks[i] > 0)).sum()) for i, v in all_values.items()) / max(
            1, shard.num_tokens
        )
    else:
        advantages = token_advantages(samples, algorithm, masks=all_masks, kl=all_kl, advantage_fn=advantage_fn)
    if distill is not None and sampled_distill:
        assert old is not None
        advantages, distill_metrics = distill_advantages(
            distill, advantages, shard=shard, micro_batches=mbs, student=old, masks=masks
        )
        metrics.update(distill_metrics)
    elif distill is not None and distill.mode == "replace":  # "full": the divergence alone trains
        advantages = {i: np.zeros_like(a) for i, a in advantages.items()}
    distill_term = distill.term() if distill is not None else None
    mbs = scatter_token_values(mbs, "advantages", {i: advantages[rank + i * world] for i in mine})
    loss_fn = loss_fn if loss_fn is not None else default_loss_fn(config)
    for _ in range(algorithm.num_updates_per_batch):
        fb = forward_backward(
            components,
            mbs,
            loss_fn,
            num_tokens=shard.num_tokens,
            num_sequences=shard.num_sequences,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            distill=distill_term,
        )
        fb["loss"] = global_sum(fb["loss"])  # the step's loss over all ranks (itself on one process)
        if distill_term is not None:  # this rank's token-mean -> the step's, over every rank
            local = fb[DISTILL_DIVERGENCE_METRIC] * fb["num_loss_tokens"]
            fb[DISTILL_DIVERGENCE_METRIC] = global_sum(local) / max(1, shard.num_tokens)
        state, om = optim_step(
            components, state, config.optimizer, num_tokens=shard.num_tokens, num_samples=len(samples), loss=fb["loss"]
        )
        metrics.update(fb)
        metrics.update(om)
    if critic is not None and algorithm.advantage_estimator == "gae":
        for _ in range(algorithm.num_updates_per_batch):
            vf = critic_forward_backward(critic, mbs, num_tokens=shard.num_tokens, clip_range=config.critic.clip_range)
            vf["vf_loss"] = global_sum(vf["vf_loss"])
            _, critic_metrics = optim_step(critic, TrainingState(), config.critic.optimizer, loss=vf["vf_loss"])
            metrics.update(vf, vf_grad_norm=critic_metrics["grad_norm"])
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
    """Every generation error (engine, URL, status, message as the engine client reported it; an
    environment's failure) and reward error of a step's batch: one entry per failed request, by the
    error it failed with (the manager's error_causes), or its first messages where none are counted."""
    counted = batch.metadata.get("error_causes")
    if isinstance(counted, Mapping):
        generation = [str(cause) for cause, num in counted.items() for _ in range(int(num))]
    else:
        generation = [str(e) for e in batch.metadata.get("errors", ())]
    return generation + reward_errors(batch.samples)


COMPLETIONS_FILE = "completions.jsonl"
"""Where a run directory keeps the completions the loop shows each step (one JSON line each)."""


def log_completions(batch: RolloutBatch, step: int, num: int, *, run_dir: Path | None = None) -> None:
    """A few of the step's completions (rank 0): prompt, response and reward, appended to the run
    directory's completions.jsonl, and logged at INFO on a terminal (DEBUG otherwise: a log file
    keeps the progress lines readable)."""
    if rank_world()[0] != 0 or num < 1:
        return
    shown = batch.samples[:num]
    if run_dir is not None:
        with (run_dir / COMPLETIONS_FILE).open("a", encoding="utf-8") as f:
            for s in shown:
                f.write(
                    json.dumps({"step": step, "prompt": s.prompt, "response": s.response, "reward": s.reward}) + "\n"
                )
    level = logging.INFO if sys.stderr.isatty() else logging.DEBUG
    for sample in shown:
        log.log(
            level,
            "step %d completion: prompt=%.200r response=%.300r reward=%s",
            step,
            sample.prompt,
            sample.response,
            sample.reward,
        )
