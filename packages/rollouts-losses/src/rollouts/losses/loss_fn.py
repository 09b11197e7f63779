"""Ready-made loss functions for a trainer: one call per micro-batch, `(loss, metrics)` back.

Legend: B rows, T tokens per row. The batch holds the micro-batch tensors (all [B, T], token-aligned):
  loss_mask (required), segment_ids (packed rows; -1 on padding), advantages (RL),
  old_logprobs (absent: the current log-probs detached, i.e. on-policy ratio 1),
  ref_logprobs (needed when the KL goes in the loss), rollout_logprobs (needed when is_cap is set).
`num_tokens` and `num_sequences` are the counts for the whole optimizer step, so the losses of a
step's micro-batches, each backpropagated, add up to the loss of the step as one batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rollouts.types.configs import AlgorithmConfig
from torch import Tensor

from rollouts.losses.aggregate import AGGREGATION_MODES, Aggregation, aggregate, check_mode, masked_mean
from rollouts.losses.kl import importance_weights, kl_penalty
from rollouts.losses.policy import cispo_loss, gspo_loss, metrics_to_floats, pg_loss, ppo_clip_loss, sft_loss

__all__ = ["LossFn", "PolicyLossFn", "SFTLossFn", "loss_fn_from_config", "sft_loss_fn"]


@runtime_checkable
class LossFn(Protocol):
    """What a trainer calls per micro-batch: [B, T] log-probs and the batch -> (scalar loss, float metrics)."""

    needs_entropy: bool
    """Whether the trainer must pass entropy_B_T (it computes entropy only when asked)."""

    def __call__(
        self,
        logprobs_B_T: Tensor,
        batch: Mapping[str, Tensor],
        *,
        num_tokens: int,
        num_sequences: int,
        entropy_B_T: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]: ...


def _require(batch: Mapping[str, Any], key: str, why: str) -> Tensor:
    """batch[key], or a ValueError naming the key and why it is needed."""
    if key not in batch or batch[key] is None:
        raise ValueError(f"batch has no {key!r} (keys: {sorted(batch)}), which {why}")
    return batch[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class SFTLossFn:
    """Masked negative log-likelihood over the loss mask."""

    mode: Aggregation = "token-mean"
    norm_constant: float | None = None
    """Divisor for seq-mean-token-sum-norm (None: the padded length)."""
    needs_entropy: bool = False

    def __post_init__(self) -> None:
        check_mode(self.mode)

    def __call__(
        self,
        logprobs_B_T: Tensor,
        batch: Mapping[str, Tensor],
        *,
        num_tokens: int | None,
        num_sequences: int | None,
        entropy_B_T: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """[B, T] log-probs, micro-batch -> (NLL with step-wide denominators, metrics)."""
        loss, metrics = sft_loss(
            logprobs_B_T, _require(batch, "loss_mask", "every loss needs"), mode=self.mode,
            norm_constant=self.norm_constant, segment_ids_B_T=batch.get("segment_ids"), num_tokens=num_tokens,
            num_sequences=num_sequences,
        )
        if entropy_B_T is not None:
            metrics |= metrics_to_floats(entropy=masked_mean(entropy_B_T.detach(), batch["loss_mask"]))
        return loss, {"loss": float(loss.detach())} | metrics


def sft_loss_fn(*, mode: Aggregation = "token-mean", norm_constant: float | None = None) -> SFTLossFn:
    """The SFT loss for a trainer: masked NLL reduced by mode."""
    return SFTLossFn(mode=mode, norm_constant=norm_constant)


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyLossFn:
    """The RL loss an AlgorithmConfig describes: policy loss + KL-in-loss - entropy bonus, with IS correction."""

    algorithm: AlgorithmConfig

    @property
    def needs_entropy(self) -> bool:
        """Entropy is needed when the loss carries an entropy bonus."""
        return self.algorithm.entropy_coef > 0.0

    def __call__(
        self,
        logprobs_B_T: Tensor,
        batch: Mapping[str, Tensor],
        *,
        num_tokens: int | None,
        num_sequences: int | None,
        entropy_B_T: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """[B, T] log-probs, micro-batch -> (policy loss with step-wide denominators, metrics)."""
        cfg = self.algorithm
        mask_B_T = _require(batch, "loss_mask", "every loss needs")
        advantages_B_T = _require(batch, "advantages", "policy losses need")
        old_B_T = batch.get("old_logprobs")
        old_B_T = logprobs_B_T.detach() if old_B_T is None else old_B_T
        agg: dict[str, Any] = {
            "mode": cfg.loss_aggregation, "norm_constant": cfg.norm_constant,
            "segment_ids_B_T": batch.get("segment_ids"), "num_tokens": num_tokens, "num_sequences": num_sequences,
        }
        metrics: dict[str, float] = {}
        is_weights = None
        if cfg.is_cap is not None:
            rollout_B_T = _require(batch, "rollout_logprobs", f"importance weights need (is_cap={cfg.is_cap})")
            is_weights, is_metrics = importance_weights(
                old_B_T, rollout_B_T, mask_B_T, cap=cfg.is_cap, level=cfg.is_level, mode=cfg.is_mode,
                segment_ids_B_T=agg["segment_ids_B_T"],
            )
            metrics |= is_metrics
        clip = {"eps_low": cfg.eps_low, "eps_high": cfg.eps_high}
        if cfg.policy_loss == "ppo_clip":
            loss, pg_metrics = ppo_clip_loss(
                logprobs_B_T, old_B_T, advantages_B_T, mask_B_T, dual_clip_c=cfg.dual_clip_c, is_weights=is_weights,
                **clip, **agg,
            )
        elif cfg.policy_loss == "gspo":
            loss, pg_metrics = gspo_loss(
                logprobs_B_T, old_B_T, advantages_B_T, mask_B_T, is_weights=is_weights, **clip, **agg
            )
        elif cfg.policy_loss == "cispo":
            loss, pg_metrics = cispo_loss(
                logprobs_B_T, old_B_T, advantages_B_T, mask_B_T, is_weights=is_weights, **clip, **agg
            )
        else:
            loss, pg_metrics = pg_loss(logprobs_B_T, advantages_B_T, mask_B_T, is_weights=is_weights, **agg)
        metrics |= pg_metrics
        ref_B_T = batch.get("ref_logprobs")
        if cfg.kl_placement == "loss" and cfg.kl_coef > 0.0:
            ref_B_T = _require(batch, "ref_logprobs", f"the KL in the loss needs (kl_coef={cfg.kl_coef})")
            kl_B_T = kl_penalty(logprobs_B_T, ref_B_T, kind=cfg.kl_kind)
            loss = loss + cfg.kl_coef * aggregate(kl_B_T, mask_B_T, **agg)
            metrics |= metrics_to_floats(kl=masked_mean(kl_B_T.detach(), mask_B_T))
        elif ref_B_T is not None:
            metrics |= metrics_to_floats(kl=masked_mean(kl_penalty(logprobs_B_T.detach(), ref_B_T, kind=cfg.kl_kind), mask_B_T))
        if cfg.entropy_coef > 0.0:
            if entropy_B_T is None:
                raise ValueError(
                    f"entropy_coef ({cfg.entropy_coef}) > 0 needs entropy_B_T: the trainer must compute it "
                    "when loss_fn.needs_entropy is True"
                )
            loss = loss - cfg.entropy_coef * aggregate(entropy_B_T, mask_B_T, **agg)
        if entropy_B_T is not None:
            metrics |= metrics_to_floats(entropy=masked_mean(entropy_B_T.detach(), mask_B_T))
        return loss, {"loss": float(loss.detach())} | metrics


def loss_fn_from_config(algorithm: AlgorithmConfig) -> PolicyLossFn:
    """The RL loss function an AlgorithmConfig describes (policy loss, KL in loss, entropy bonus, IS weights)."""
    if not isinstance(algorithm, AlgorithmConfig):
        raise TypeError(f"algorithm must be an AlgorithmConfig, got {type(algorithm).__name__}")
    assert algorithm.loss_aggregation in AGGREGATION_MODES
    return PolicyLossFn(algorithm=algorithm)
