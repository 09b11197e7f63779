"""rollouts-losses: the pure torch math of post-training (log-probs, losses, advantages, KL, rewards, EMA)."""

import importlib.metadata

from rollouts.losses.advantages import (
    broadcast_to_tokens,
    gae_advantages,
    gpg_advantages,
    group_advantages,
    masked_whiten,
    passk_advantages,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
    sample_advantages,
)
from rollouts.losses.aggregate import AGGREGATION_MODES, DEFAULT_REDUCTION, Aggregation, Reduction, aggregate
from rollouts.losses.correction import (
    high_entropy_mask,
    off_policy_diagnostics,
    off_policy_sequence_mask,
    rejection_mask,
)
from rollouts.losses.distill import check_beta, distill_divergence, fused_distill_divergence
from rollouts.losses.ema import ema_accumulators, ema_update_
from rollouts.losses.fused_logprobs import fused_block_shape, fused_token_logprobs, truncation_mask
from rollouts.losses.kl import KL_KINDS, KLControllerState, adaptive_kl_update, importance_weights, kl_penalty
from rollouts.losses.logprobs import token_entropy, token_logprobs
from rollouts.losses.loss_fn import LossFn, PolicyLossFn, SFTLossFn, loss_fn_from_config, sft_loss_fn
from rollouts.losses.metrics import Metrics, detached_metrics, floats_of, metrics_to_floats
from rollouts.losses.policy import cispo_loss, gspo_loss, pg_loss, ppo_clip_loss, sft_loss, value_loss
from rollouts.losses.policy_variants import ClipCovPick, clip_cov_loss, dppo_loss, gmpo_loss, kl_cov_loss, sapo_loss
from rollouts.losses.preference import (
    PairLogps,
    dpo_loss,
    hinge_loss,
    ipo_loss,
    kto_loss,
    orpo_loss,
    preference_loss,
    robust_dpo_loss,
    simpo_loss,
)
from rollouts.losses.rewards import (
    clip_rewards,
    combine_rewards,
    format_reward,
    math_answer_reward,
    normalize_rewards,
    overlong_penalty,
    overlong_reward,
    score_math_answer,
)


def _version() -> str:
    try:
        return importlib.metadata.version("rollouts-losses")  # written once, in pyproject.toml
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    "AGGREGATION_MODES",
    "DEFAULT_REDUCTION",
    "Aggregation",
    "ClipCovPick",
    "KLControllerState",
    "KL_KINDS",
    "LossFn",
    "Metrics",
    "PairLogps",
    "PolicyLossFn",
    "Reduction",
    "SFTLossFn",
    "adaptive_kl_update",
    "aggregate",
    "broadcast_to_tokens",
    "check_beta",
    "cispo_loss",
    "clip_cov_loss",
    "clip_rewards",
    "combine_rewards",
    "detached_metrics",
    "distill_divergence",
    "dpo_loss",
    "dppo_loss",
    "ema_accumulators",
    "ema_update_",
    "floats_of",
    "fused_distill_divergence",
    "format_reward",
    "fused_block_shape",
    "fused_token_logprobs",
    "gae_advantages",
    "gmpo_loss",
    "gpg_advantages",
    "group_advantages",
    "gspo_loss",
    "high_entropy_mask",
    "hinge_loss",
    "importance_weights",
    "ipo_loss",
    "kl_cov_loss",
    "kl_penalty",
    "kto_loss",
    "loss_fn_from_config",
    "masked_whiten",
    "math_answer_reward",
    "metrics_to_floats",
    "normalize_rewards",
    "off_policy_diagnostics",
    "off_policy_sequence_mask",
    "orpo_loss",
    "overlong_penalty",
    "overlong_reward",
    "passk_advantages",
    "pg_loss",
    "preference_loss",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "rejection_mask",
    "remax_advantages",
    "robust_dpo_loss",
    "rloo_advantages",
    "sample_advantages",
    "sapo_loss",
    "score_math_answer",
    "sft_loss",
    "sft_loss_fn",
    "simpo_loss",
    "token_entropy",
    "token_logprobs",
    "truncation_mask",
    "value_loss",
]
