"""A fixed batch and RL settings (and a distillation teacher) shared by the data-parallel rl_update test and its torchrun worker."""

from __future__ import annotations

import dataclasses

import numpy as np

from rollouts.backends import DISTILL_DIVERGENCE_METRIC, build_components
from rollouts.backends.train.distributed import shard_model
from rollouts.loops.algorithms import ALGORITHMS
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.rl.distill import REVERSE_KL_METRIC, Distillation
from rollouts.types import (
    AlgorithmConfig,
    CriticConfig,
    OptimizerConfig,
    RLConfig,
    RolloutConfig,
    Sample,
    SamplingParams,
)

VOCAB = 64
NUM_STEPS = 2
CASES: dict[str, AlgorithmConfig] = {
    # KL in the reward changes the group statistics: they need every rank's samples.
    "grpo_kl_reward": dataclasses.replace(
        ALGORITHMS["grpo"], kl_coef=0.05, kl_placement="reward", kl_kind="k3", num_updates_per_batch=2
    ),
    # Batch-wide whitening of token advantages, KL in the reward.
    "reinforce_pp": ALGORITHMS["reinforce_pp"],
    # KL in the loss, truncated importance weights, dual clip.
    "ppo_no_critic": ALGORITHMS["ppo_no_critic"],
    # A critic: GAE from its values (gathered over ranks for the whitening), its own update.
    "ppo": dataclasses.replace(ALGORITHMS["ppo"], kl_coef=0.05, kl_kind="k3"),
}


def batch() -> list[Sample]:
    """9 samples in groups of 3 (an odd count: the ranks' shares differ), lengths 5..16."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(9):
        prompt = rng.integers(2, VOCAB, size=int(rng.integers(2, 5))).tolist()
        response = rng.integers(2, VOCAB, size=int(rng.integers(3, 12))).tolist()
        samples.append(
            Sample(
                tokens=tuple(prompt + response),
                num_prompt_tokens=len(prompt),
                loss_mask=(0.0,) * len(prompt) + (1.0,) * len(response),
                rollout_logprobs=tuple(float(x) for x in -rng.uniform(3.0, 5.0, size=len(response))),
                reward=float(rng.integers(0, 2)) + 0.1 * i,
                index=i,
                group_index=i // 3,
            )
        )
    return samples


def config(algorithm: AlgorithmConfig) -> RLConfig:
    return RLConfig(
        num_steps=NUM_STEPS,
        algorithm=algorithm,
        critic=(  # only GAE reads a critic (RLConfig refuses one otherwise)
            CriticConfig(optimizer=OptimizerConfig(lr=1e-3, schedule="constant"))
            if algorithm.advantage_estimator == "gae"
            else CriticConfig()
        ),
        optimizer=OptimizerConfig(lr=1e-3, schedule="constant"),
        rollout=RolloutConfig(
            batch_size=3, samples_per_prompt=3, sampling=SamplingParams(temperature=1.0, max_new_tokens=12)
        ),
        max_tokens_per_micro_batch=24,
    )


def critic(*, sharded: bool):
    """A critic from the same starting model, its head made visible (it starts at zero)."""
    import torch

    from rollouts.backends.train.value import ValueModel

    model = ValueModel(
        build_tiny_model(
            VOCAB, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
            max_position_embeddings=64, seed=0,
        )
    )  # fmt: skip
    with torch.no_grad():
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    return build_components(
        shard_model(model) if sharded else model, OptimizerConfig(lr=1e-3, schedule="constant"), num_training_steps=8
    )


def components(*, sharded: bool):
    """(training components, reference components) of the same starting model."""

    def model():
        m = build_tiny_model(
            VOCAB,
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=128,
            max_position_embeddings=64,
            seed=0,
        )
        return shard_model(m) if sharded else m

    trained = build_components(model(), OptimizerConfig(lr=1e-3, schedule="constant"), num_training_steps=8)
    return trained, dataclasses.replace(trained, model=model().eval())


DISTILL_METRICS = (REVERSE_KL_METRIC, DISTILL_DIVERGENCE_METRIC)
DISTILL_CASES = {"distill": {}, "distill_full": {"estimate": "full", "beta": 0.5}}
"""Name -> Distillation options: the sampled-token advantage, and GKD's full-vocabulary JSD term."""


def distillation(*, sharded: bool, estimate: str = "sampled", beta: float = 1.0):
    """On-policy distillation from another model of the same vocabulary (frozen, sharded like the
    policy under torchrun), added to GRPO's advantage: the group statistics need the whole batch,
    the teacher's term each rank's own samples."""
    model = build_tiny_model(
        VOCAB, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
        max_position_embeddings=64, seed=1,
    )  # fmt: skip
    teacher = build_components(
        (shard_model(model) if sharded else model).eval(), OptimizerConfig(), num_training_steps=1
    )
    return Distillation(teacher=teacher, coef=0.5, mode="add", estimate=estimate, beta=beta)
