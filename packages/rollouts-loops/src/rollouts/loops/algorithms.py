"""Named presets of AlgorithmConfig (and the rollout settings an algorithm implies).

Each preset follows its paper's defaults where they are settings of our configs; departures:
- grpo: no KL term by default (kl_coef 0); set kl_coef with kl_placement="loss" for the paper's
  k3 penalty, at the cost of a reference forward pass per step.
- ppo: PPO with a critic (GAE with lambda 0.95 over the trained tokens from a learned value model,
  RLConfig.critic), KL to the reference in the reward as in InstructGPT.
- ppo_no_critic: PPO without a value model: REINFORCE++-style advantages (batch-normalized
  returns), the clipped surrogate with dual clip, KL in the loss and truncated importance weights
  (engine vs trainer log-probs).
- sapo, gmpo, clip_cov, kl_cov: GRPO advantages with the paper's loss and verl's defaults
  (rollouts.losses.policy_variants names the peer file of each).
- dppo: prime-rl's default loss (binary-TV trust region 0.2 around the engine's policy, plus
  1e-3 (log pi - log pi_rollout)^2); dppo_kl: the binary-KL variant, whose threshold 0.05 is our
  choice (a probability move of 0.2 from p = 0.2 to 0.5 has binary KL about 0.09).
- kl_cov: the Entropy-Mechanism recipe's 2e-3 of tokens (clip_cov keeps verl's 2e-4).
- gpg (arXiv 2504.02546): plain policy gradient -A log pi with no ratio, clip or KL, advantages
  alpha (r - group mean) (rollouts.losses.gpg_advantages), token-mean as in verl's gpg loss.
- grpo_passk (verl "grpo_passk"): GRPO's clipped surrogate with only each group's best sample
  credited (rollouts.losses.passk_advantages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from rollouts.types import AlgorithmConfig

ALGORITHMS: Mapping[str, AlgorithmConfig] = MappingProxyType(
    {
        "grpo": AlgorithmConfig(
            advantage_estimator="grpo",
            advantage_scale="group",
            policy_loss="ppo_clip",
            loss_aggregation="seq-mean-token-mean",
        ),
        "drgrpo": AlgorithmConfig(
            advantage_estimator="grpo",
            advantage_scale="none",
            policy_loss="ppo_clip",
            loss_aggregation="seq-mean-token-sum-norm",
        ),
        "dapo": AlgorithmConfig(
            advantage_estimator="grpo",
            advantage_scale="group",
            policy_loss="ppo_clip",
            eps_low=0.2,
            eps_high=0.28,
            loss_aggregation="token-mean",
            overlong_buffer_length=64,
            overlong_penalty_factor=1.0,
        ),
        "gspo": AlgorithmConfig(
            advantage_estimator="grpo",
            policy_loss="gspo",
            eps_low=3e-4,
            eps_high=4e-4,
            loss_aggregation="seq-mean-token-mean",
        ),
        "cispo": AlgorithmConfig(
            advantage_estimator="grpo",
            policy_loss="cispo",
            eps_low=0.99,
            eps_high=0.28,
            loss_aggregation="token-mean",
        ),
        "rloo": AlgorithmConfig(advantage_estimator="rloo", policy_loss="ppo_clip", loss_aggregation="token-mean"),
        "reinforce_pp": AlgorithmConfig(
            advantage_estimator="reinforce_pp",
            policy_loss="ppo_clip",
            loss_aggregation="token-mean",
            kl_kind="k1",
            kl_coef=0.01,
            kl_placement="reward",
        ),
        # PPO's clipped surrogate with REINFORCE++ advantages (no value model), KL in the loss,
        # truncated IS weights and dual clip.
        "ppo_no_critic": AlgorithmConfig(
            advantage_estimator="reinforce_pp",
            policy_loss="ppo_clip",
            loss_aggregation="token-mean",
            kl_kind="low_var_kl",
            kl_coef=0.001,
            kl_placement="loss",
            is_cap=2.0,
            dual_clip_c=3.0,
        ),
        # PPO with a critic: GAE over the trained tokens from a learned value model (RLConfig.critic;
        # the loop builds it from the starting model), KL to the reference in the reward.
        "ppo": AlgorithmConfig(
            advantage_estimator="gae",
            policy_loss="ppo_clip",
            loss_aggregation="token-mean",
            gamma=1.0,
            lam=0.95,
            kl_kind="k1",
            kl_coef=0.001,
            kl_placement="reward",
        ),
        "sapo": AlgorithmConfig(
            advantage_estimator="grpo",
            policy_loss="sapo",
            sapo_tau_pos=1.0,
            sapo_tau_neg=1.05,
            loss_aggregation="seq-mean-token-mean",
        ),
        "gmpo": AlgorithmConfig(
            advantage_estimator="grpo",
            policy_loss="gmpo",
            eps_low=0.4,
            eps_high=0.4,
            loss_aggregation="seq-mean-token-mean",
        ),
        "dppo": AlgorithmConfig(
            advantage_estimator="grpo",
            policy_loss="dppo_tv",
            eps_low=0.2,
            eps_high=0.2,
            log_ratio_sq_coef=1e-3,
            loss_aggregation="token-mean",
        ),
        "dppo_kl": AlgorithmConfig(
            advantage_estimator="grpo",
            policy_loss="dppo_kl",
            eps_low=0.05,
            eps_high=0.05,
            log_ratio_sq_coef=1e-3,
            loss_aggregation="token-mean",
        ),
        "clip_cov": AlgorithmConfig(
            advantage_estimator="grpo",
            policy_loss="clip_cov",
            eps_low=0.2,
            eps_high=0.2,
            cov_fraction=2e-4,
            clip_cov_bounds=(1.0, 5.0),
            loss_aggregation="token-mean",
        ),
        "kl_cov": AlgorithmConfig(
            advantage_estimator="grpo",
            policy_loss="kl_cov",
            cov_fraction=2e-3,
            kl_cov_coef=1.0,
            loss_aggregation="token-mean",
        ),
        "gpg": AlgorithmConfig(advantage_estimator="gpg", policy_loss="pg", loss_aggregation="token-mean"),
        "grpo_passk": AlgorithmConfig(
            advantage_estimator="grpo_passk", policy_loss="ppo_clip", loss_aggregation="token-mean"
        ),
        # ReMax (Li et al. 2023, arXiv 2310.10505): REINFORCE with the reward of the greedy response to
        # the same prompt as the baseline; the loop generates that greedy rollout (not trained on).
        "remax": AlgorithmConfig(advantage_estimator="remax", policy_loss="pg", loss_aggregation="token-mean"),
    }
)

ROLLOUT_IMPLIED: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {"dapo": MappingProxyType({"dynamic_sampling": True, "over_sampling_factor": 1.5})}
)
"""Rollout settings an algorithm implies (DAPO's dynamic sampling), applied under user settings."""


def algorithm_preset(name: str) -> AlgorithmConfig:
    """The AlgorithmConfig of a named preset; raises naming the allowed names."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm preset {name!r}; allowed: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


def preset_dicts(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(algorithm fields, rollout fields) of a preset as plain dicts, to merge user settings over."""
    algorithm = dataclasses.asdict(algorithm_preset(name))
    return algorithm, dict(ROLLOUT_IMPLIED.get(name, {}))
