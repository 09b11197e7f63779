"""GRPO in one screen: the algorithm of `rl.py` without its plumbing.

No rollout manager (no over-sampling, retries or carry-over), no overlap, no checkpoints, no
KL: sample a group per prompt, score, normalize within groups, one policy-gradient step.
Read this first; use `run_rl_training` for real runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import trio

from rollouts.backends import TrainingComponents, forward_backward, optim_step
from rollouts.data import DataBuffer, plan_micro_batches
from rollouts.losses import group_advantages, loss_fn_from_config
from rollouts.types import AlgorithmConfig, InferenceEngine, OptimizerConfig, Sample, SamplingParams, TrainingState


def grpo_minimal(
    components: TrainingComponents,
    engine: InferenceEngine,
    prompts: DataBuffer,
    *,
    encode_prompt: Callable[[Any], Sequence[int]],
    reward: Callable[[Sample, Any], float],
    num_steps: int,
    prompts_per_step: int,
    samples_per_prompt: int,
    sampling: SamplingParams,
    optimizer: OptimizerConfig,
    max_tokens_per_micro_batch: int = 8192,
) -> tuple[TrainingState, list[float]]:
    """Train `num_steps` GRPO steps; returns the final state and the mean reward of each step.

    `engine` samples from `components.model` itself (an in-process engine sharing the model), so
    step 5 only records the new weight version; a remote engine needs exported weights instead.
    """
    state, mean_rewards = TrainingState(), []
    loss_fn = loss_fn_from_config(AlgorithmConfig())  # PPO-clip; with one update per batch, plain PG
    params = dataclasses.replace(sampling, n=samples_per_prompt)
    for _ in range(num_steps):
        records = prompts.get_prompts(prompts_per_step)
        # 1. rollouts: n samples per prompt, prompt-major, from the current weights
        samples = trio.run(engine.generate, [list(encode_prompt(r)) for r in records], params)
        # 2. rewards (the record's fields, e.g. the answer, ride along in metadata)
        samples = [s.with_metadata(**records[i // samples_per_prompt]) for i, s in enumerate(samples)]
        samples = [s.with_reward(float(reward(s, records[i // samples_per_prompt]))) for i, s in enumerate(samples)]
        # 3. advantages: (r - group mean) / group std
        rewards = torch.tensor([s.reward for s in samples])
        groups = torch.arange(len(records)).repeat_interleave(samples_per_prompt)
        advantages = group_advantages(rewards, groups)
        samples = [s.with_advantage(float(a)) for s, a in zip(samples, advantages, strict=True)]
        # 4. one optimizer step over packed micro-batches, normalized over the whole step
        plan = plan_micro_batches(samples, max_tokens=max_tokens_per_micro_batch)
        metrics = forward_backward(components, plan.micro_batches, loss_fn,
                                   num_tokens=plan.num_loss_tokens, num_sequences=plan.num_sequences)
        state, _ = optim_step(components, state, optimizer, num_tokens=plan.num_loss_tokens,
                              num_samples=len(samples), loss=metrics["loss"])
        # 5. the engine samples from the trained weights next step (shared model: only the version)
        state = state.with_weight_version(state.weight_version + 1)
        trio.run(engine.update_weights_from_disk, "", state.weight_version)
        mean_rewards.append(float(rewards.mean()))
    return state, mean_rewards
