"""Ready-made loss functions for a trainer: one call per micro-batch, `(loss, metrics)` back.

Legend: B rows, T tokens per row. The batch is a `rollouts.types.MicroBatch` of tensors (all [B, T], token-aligned):
  loss_mask (required), segment_ids (packed rows; -1 on padding), advantages (RL),
  old_logprobs (absent: the current log-probs detached, i.e. on-policy ratio 1),
  ref_logprobs (needed when the KL goes in the loss), rollout_logprobs (needed when
  AlgorithmConfig.needs_rollout_logprobs: IS weights, rejection, the off-policy sequence mask).
When the batch has rollout_logprobs, the off-policy diagnostics (ESS, chi-square, log-prob drift)
are in the metrics. IS weights, rejection masks, the off-policy sequence mask and the high-entropy
token mask all multiply the per-token loss; the denominators (step-wide counts) stay as they are.
DPPO's trust region is around the engine's policy (prime-rl): its ratio uses rollout_logprobs
when the batch has them, else old_logprobs (Stable-RL's "recompute" variant).
`num_tokens` and `num_sequences` are the counts for the whole optimizer step, so the losses of a
step's micro-batches, each backpropagated, add up to the loss of the step as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, TypedDict, runtime_checkable

import torch
from torch import Tensor

from rollouts.losses.aggregate import AGGREGATION_MODES, Aggregation, Reduction, check_mode, masked_mean
from rollouts.losses.correction import (
    high_entropy_mask,
    off_policy_diagnostics,
    off_policy_sequence_mask,
    rejection_mask,
)
from rollouts.losses.kl import importance_weights, kl_penalty
from rollouts.losses.metrics import Metrics, detached_metrics
from rollouts.losses.policy import cispo_loss, gspo_loss, pg_loss, ppo_clip_loss, sft_loss
from rollouts.losses.policy_variants import ClipCovPick, clip_cov_loss, dppo_loss, gmpo_loss, kl_cov_loss, sapo_loss
from rollouts.types.configs import AlgorithmConfig
from rollouts.types.micro_batch import MicroBatch

__all__ = ["LossFn", "PolicyLossFn", "SFTLossFn", "loss_fn_from_config", "sft_loss_fn"]


@runtime_checkable
class LossFn(Protocol):
    """What a trainer calls per micro-batch: [B, T] log-probs and the batch -> (scalar loss, metrics).

    The metrics may be floats or 0-dim tensors (rollouts.losses.metrics); the built-in losses give
    detached tensors, which the trainer reads once per step."""

    @property
    def needs_entropy(self) -> bool:
        """Whether the trainer must pass entropy_B_T (it computes entropy only when asked)."""
        ...

    def __call__(
        self,
        logprobs_B_T: Tensor,
        batch: MicroBatch[Tensor],
        *,
        num_tokens: int,
        num_sequences: int,
        entropy_B_T: Tensor | None = None,
    ) -> tuple[Tensor, Metrics]: ...


class _Clip(TypedDict):
    eps_low: float
    eps_high: float


def _require(batch: MicroBatch[Tensor], key: str, why: str) -> Tensor:
    """The micro-batch's array `key`, or a ValueError naming the key and why it is needed."""
    if not isinstance(batch, MicroBatch):
        raise TypeError(f"a loss takes a rollouts.types.MicroBatch of tensors, got {type(batch).__name__}")
    value = batch.get(key)
    if value is None:
        raise ValueError(f"the micro-batch has no {key!r} (it has {sorted(batch.token_arrays())}), which {why}")
    return value


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
        batch: MicroBatch[Tensor],
        *,
        num_tokens: int | None,
        num_sequences: int | None,
        entropy_B_T: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """[B, T] log-probs, micro-batch -> (NLL with step-wide denominators, metrics)."""
        loss, metrics = sft_loss(
            logprobs_B_T,
            _require(batch, "loss_mask", "every loss needs"),
            reduction=Reduction(
                mode=self.mode,
                norm_constant=self.norm_constant,
                segment_ids_B_T=batch.segment_ids,
                num_tokens=num_tokens,
                num_sequences=num_sequences,
            ),
        )
        if entropy_B_T is not None:
            metrics |= detached_metrics(entropy=masked_mean(entropy_B_T.detach(), batch.loss_mask))
        return loss, {"loss": loss.detach()} | metrics


def sft_loss_fn(*, mode: Aggregation = "token-mean", norm_constant: float | None = None) -> SFTLossFn:
    """The SFT loss for a trainer: masked NLL reduced by mode."""
    return SFTLossFn(mode=mode, norm_constant=norm_constant)


def _times(weights_B_T: Tensor | None, factor_B_T: Tensor) -> Tensor:
    """weights * factor, where None weights mean 1."""
    return factor_B_T if weights_B_T is None else weights_B_T * factor_B_T


def _token_weights(
    cfg: AlgorithmConfig,
    logprobs_B_T: Tensor,
    old_B_T: Tensor,
    batch: MicroBatch[Tensor],
    entropy_B_T: Tensor | None,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The per-token loss multiplier (IS weights x rejection x off-policy mask x entropy mask; None: 1) and metrics."""
    mask_B_T, segment_ids_B_T = batch.loss_mask, batch.segment_ids
    rollout_B_T = batch.rollout_logprobs
    if cfg.needs_rollout_logprobs:
        rollout_B_T = _require(batch, "rollout_logprobs", "IS weights, rejection and the off-policy mask need")
    weights_B_T: Tensor | None = None
    metrics: dict[str, Tensor] = {}
    if rollout_B_T is not None:
        metrics |= off_policy_diagnostics(old_B_T, rollout_B_T, mask_B_T, segment_ids_B_T=segment_ids_B_T)
    # Each branch below is one that cfg.needs_rollout_logprobs names, so _require gave rollout_B_T.
    if cfg.is_cap is not None:
        assert rollout_B_T is not None
        weights_B_T, is_metrics = importance_weights(
            old_B_T,
            rollout_B_T,
            mask_B_T,
            cap=cfg.is_cap,
            level=cfg.is_level,
            mode=cfg.is_mode,
            segment_ids_B_T=segment_ids_B_T,
        )
        metrics |= is_metrics
    if cfg.rs_level != "none":
        assert rollout_B_T is not None
        keep_B_T, rs_metrics = rejection_mask(
            old_B_T,
            rollout_B_T,
            mask_B_T,
            estimator=cfg.rs_estimator,
            level=cfg.rs_level,
            low=cfg.rs_low,
            high=cfg.rs_high,
            segment_ids_B_T=segment_ids_B_T,
        )
        weights_B_T, metrics = _times(weights_B_T, keep_B_T), metrics | rs_metrics
    if cfg.off_policy_mask_threshold is not None:
        assert rollout_B_T is not None
        keep_B_T, opm_metrics = off_policy_sequence_mask(
            logprobs_B_T,
            rollout_B_T,
            _require(batch, "advantages", "the off-policy sequence mask needs"),
            mask_B_T,
            threshold=cfg.off_policy_mask_threshold,
            segment_ids_B_T=segment_ids_B_T,
        )
        weights_B_T, metrics = _times(weights_B_T, keep_B_T), metrics | opm_metrics
    if cfg.top_entropy_quantile < 1.0:
        if entropy_B_T is None:
            raise ValueError(
                f"top_entropy_quantile ({cfg.top_entropy_quantile}) < 1 needs entropy_B_T: the trainer must compute "
                "it when loss_fn.needs_entropy is True"
            )
        keep_B_T = high_entropy_mask(entropy_B_T, mask_B_T, top_quantile=cfg.top_entropy_quantile)
        weights_B_T = _times(weights_B_T, keep_B_T)
        metrics |= detached_metrics(entropy_mask_frac=masked_mean(keep_B_T, mask_B_T))
    return weights_B_T, metrics


def _policy_loss(
    cfg: AlgorithmConfig,
    logprobs_B_T: Tensor,
    old_B_T: Tensor,
    batch: MicroBatch[Tensor],
    is_weights: Tensor | None,
    reduction: Reduction,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The configured policy loss on one micro-batch."""
    advantages_B_T = _require(batch, "advantages", "every policy loss needs")
    args = (logprobs_B_T, old_B_T, advantages_B_T, batch.loss_mask)
    clip = _Clip(eps_low=cfg.eps_low, eps_high=cfg.eps_high)
    loss = cfg.policy_loss
    if loss == "ppo_clip":
        return ppo_clip_loss(*args, dual_clip_c=cfg.dual_clip_c, is_weights=is_weights, reduction=reduction, **clip)
    if loss in ("gspo", "cispo", "gmpo"):
        fn = {"gspo": gspo_loss, "cispo": cispo_loss, "gmpo": gmpo_loss}[loss]
        return fn(*args, is_weights=is_weights, reduction=reduction, **clip)
    if loss == "sapo":
        tau_pos, tau_neg = cfg.sapo_tau_pos, cfg.sapo_tau_neg
        return sapo_loss(*args, tau_pos=tau_pos, tau_neg=tau_neg, is_weights=is_weights, reduction=reduction)
    if loss in ("dppo_tv", "dppo_kl"):
        divergence: Literal["tv", "kl"] = "tv" if loss == "dppo_tv" else "kl"
        return dppo_loss(*args, divergence=divergence, is_weights=is_weights, reduction=reduction, **clip)
    if loss == "clip_cov":
        pick = ClipCovPick(cov_fraction=cfg.cov_fraction, cov_bounds=cfg.clip_cov_bounds)
        return clip_cov_loss(*args, pick=pick, is_weights=is_weights, reduction=reduction, **clip)
    if loss == "kl_cov":
        fraction, coef = cfg.cov_fraction, cfg.kl_cov_coef
        return kl_cov_loss(*args, cov_fraction=fraction, kl_coef=coef, is_weights=is_weights, reduction=reduction)
    assert loss == "pg", loss
    return pg_loss(logprobs_B_T, advantages_B_T, batch.loss_mask, is_weights=is_weights, reduction=reduction)


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyLossFn:
    """The RL loss an AlgorithmConfig describes: policy loss + KL-in-loss - entropy bonus, with IS correction,
    rejection, the off-policy sequence mask and the high-entropy token mask."""

    algorithm: AlgorithmConfig

    @property
    def needs_entropy(self) -> bool:
        """Entropy is needed for an entropy bonus or the high-entropy token mask."""
        return self.algorithm.entropy_coef > 0.0 or self.algorithm.top_entropy_quantile < 1.0

    def __call__(
        self,
        logprobs_B_T: Tensor,
        batch: MicroBatch[Tensor],
        *,
        num_tokens: int | None,
        num_sequences: int | None,
        entropy_B_T: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """[B, T] log-probs, micro-batch -> (policy loss with step-wide denominators, metrics)."""
        cfg = self.algorithm
        mask_B_T = _require(batch, "loss_mask", "every loss needs")
        _require(batch, "advantages", "policy losses need")
        old_B_T = batch.old_logprobs
        old_B_T = logprobs_B_T.detach() if old_B_T is None else old_B_T
        reduction = Reduction(
            mode=cfg.loss_aggregation,
            norm_constant=cfg.norm_constant,
            segment_ids_B_T=batch.segment_ids,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
        )
        is_weights, metrics = _token_weights(cfg, logprobs_B_T, old_B_T, batch, entropy_B_T)
        ratio_base_B_T = old_B_T
        if cfg.policy_loss in ("dppo_tv", "dppo_kl") and batch.rollout_logprobs is not None:
            ratio_base_B_T = batch.rollout_logprobs
        loss, pg_metrics = _policy_loss(cfg, logprobs_B_T, ratio_base_B_T, batch, is_weights, reduction)
        metrics |= pg_metrics
        if cfg.log_ratio_sq_coef > 0.0:
            selected_B_T = mask_B_T > 0
            log_ratio_B_T = torch.where(selected_B_T, logprobs_B_T, 0.0) - torch.where(
                selected_B_T, ratio_base_B_T.detach(), 0.0
            )
            loss = loss + cfg.log_ratio_sq_coef * reduction.apply(log_ratio_B_T.square(), mask_B_T)
        ref_B_T = batch.ref_logprobs
        if cfg.kl_placement == "loss" and cfg.kl_coef > 0.0:
            ref_B_T = _require(batch, "ref_logprobs", f"the KL in the loss needs (kl_coef={cfg.kl_coef})")
            kl_B_T = kl_penalty(logprobs_B_T, ref_B_T, kind=cfg.kl_kind)
            loss = loss + cfg.kl_coef * reduction.apply(kl_B_T, mask_B_T)
            metrics |= detached_metrics(kl=masked_mean(kl_B_T.detach(), mask_B_T))
        elif ref_B_T is not None:
            metrics |= detached_metrics(
                kl=masked_mean(kl_penalty(logprobs_B_T.detach(), ref_B_T, kind=cfg.kl_kind), mask_B_T)
            )
        if cfg.entropy_coef > 0.0:
            if entropy_B_T is None:
                raise ValueError(
                    f"entropy_coef ({cfg.entropy_coef}) > 0 needs entropy_B_T: the trainer must compute it "
                    "when loss_fn.needs_entropy is True"
                )
            loss = loss - cfg.entropy_coef * reduction.apply(entropy_B_T, mask_B_T)
        if entropy_B_T is not None:
            metrics |= detached_metrics(entropy=masked_mean(entropy_B_T.detach(), mask_B_T))
        return loss, {"loss": loss.detach()} | metrics


def loss_fn_from_config(algorithm: AlgorithmConfig) -> PolicyLossFn:
    """The RL loss function an AlgorithmConfig describes (policy loss, KL in loss, entropy bonus, IS weights)."""
    if not isinstance(algorithm, AlgorithmConfig):
        raise TypeError(f"algorithm must be an AlgorithmConfig, got {type(algorithm).__name__}")
    assert algorithm.loss_aggregation in AGGREGATION_MODES
    return PolicyLossFn(algorithm=algorithm)
