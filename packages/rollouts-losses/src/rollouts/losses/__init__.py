"""rollouts-losses: the pure torch math of post-training (log-probs, losses, advantages, KL, rewards)."""

from rollouts.losses.aggregate import AGGREGATION_MODES, Aggregation, aggregate
from rollouts.losses.kl import KL_KINDS, importance_weights, kl_penalty
from rollouts.losses.logprobs import fused_token_logprobs, token_entropy, token_logprobs
from rollouts.losses.loss_fn import LossFn, PolicyLossFn, SFTLossFn, loss_fn_from_config, sft_loss_fn
from rollouts.losses.policy import cispo_loss, gspo_loss, pg_loss, ppo_clip_loss, sft_loss, value_loss

__version__ = "0.1.0"

__all__ = [
    "AGGREGATION_MODES",
    "KL_KINDS",
    "Aggregation",
    "LossFn",
    "PolicyLossFn",
    "SFTLossFn",
    "aggregate",
    "cispo_loss",
    "fused_token_logprobs",
    "gspo_loss",
    "importance_weights",
    "kl_penalty",
    "loss_fn_from_config",
    "pg_loss",
    "ppo_clip_loss",
    "sft_loss",
    "sft_loss_fn",
    "token_entropy",
    "token_logprobs",
    "value_loss",
]
