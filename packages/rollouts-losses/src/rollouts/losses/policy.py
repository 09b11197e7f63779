"""SFT and policy-gradient losses: masked NLL, PPO clip (clip-higher, dual clip), GSPO, CISPO, REINFORCE, value.

Legend: B rows, T tokens per row. Every per-token tensor is [B, T] and aligned with input_ids.
Every loss returns `(scalar loss, metrics)` with metrics as 0-dim detached tensors (means over loss tokens,
read by the trainer once per step: metrics.py).
Every loss takes a `Reduction` (aggregate.py): the mode, norm_constant, segment_ids_B_T (packed
rows), num_tokens and num_sequences (step-wide denominators for micro-batches). Its mode None is
the loss's own default: seq-mean-token-mean for GSPO, token-mean for the others.

Departures from the papers:
- The log-ratio log(pi / pi_old) is clamped to +-20 before exp() in PPO and CISPO (as verl does);
  GSPO's sequence log-ratio is clamped above at 10 and not below, as verl's GSPO is.
- GSPO's sequence ratio is computed per segment on packed rows; its token length counts the
  tokens with mask > 0 (mask weights scale the loss, not the length).
- `is_weights` multiply the per-token loss and are never differentiated (truncated importance
  sampling for the rollout-engine vs trainer mismatch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollouts.losses.aggregate import (
    DEFAULT_REDUCTION,
    Reduction,
    check_same_shape,
    masked_mean,
    safe_divide,
    sequence_present,
    sequence_sums,
    to_tokens,
)
from rollouts.losses.metrics import detached_metrics

__all__ = ["cispo_loss", "gspo_loss", "pg_loss", "ppo_clip_loss", "sft_loss", "value_loss"]

MAX_LOG_RATIO = 20.0
"""Clamp on log(pi / pi_old) before exp(): a stale or mismatched rollout cannot overflow the ratio."""
GSPO_MAX_LOG_RATIO = 10.0
"""Upper clamp on GSPO's sequence log-ratio before exp() (verl's GSPO clamp): a sequence's ratio is
at most e^10; no lower clamp, since exp() of a very negative mean cannot overflow."""


def _check_eps(eps_low: float, eps_high: float) -> None:
    """Raise unless eps_low >= 0 and eps_high >= 0. eps_low >= 1 puts the lower clip at or below 0,
    where no ratio reaches it: no lower clip (verl's CISPO example sets clip_ratio_low = 10)."""
    if not eps_low >= 0.0:
        raise ValueError(f"eps_low must be >= 0 (>= 1: no lower clip), got {eps_low!r}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high!r}")


def _masked_extremes(x_B_T: Tensor, mask_B_T: Tensor, *, empty: float) -> tuple[Tensor, Tensor]:
    """(min, max) of x over tokens with mask > 0, or (empty, empty) when there are none."""
    selected = mask_B_T > 0
    if x_B_T.numel() == 0:
        return torch.tensor(empty), torch.tensor(empty)
    low = torch.where(selected, x_B_T, torch.inf).min()
    high = torch.where(selected, x_B_T, -torch.inf).max()
    any_selected = selected.any()
    return torch.where(any_selected, low, empty), torch.where(any_selected, high, empty)


def _zero_unselected(mask_B_T: Tensor, *tensors_B_T: Tensor) -> tuple[Tensor, ...]:
    """Each tensor with 0 wherever the mask is 0: a NaN or inf there (padding, a -inf log-prob) then
    reaches neither the loss nor, through torch.where's backward, any gradient."""
    selected = mask_B_T > 0
    return tuple(torch.where(selected, t, torch.zeros((), dtype=t.dtype, device=t.device)) for t in tensors_B_T)


def _weighted(loss_B_T: Tensor, is_weights: Tensor | None) -> Tensor:
    """Multiply by the (never differentiated) importance weights, if any."""
    return loss_B_T if is_weights is None else loss_B_T * is_weights.detach()


def sft_loss(
    logprobs_B_T: Tensor,
    loss_mask_B_T: Tensor,
    *,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] log-probs and loss mask -> masked negative log-likelihood, reduced by mode."""
    check_same_shape(logprobs_B_T=logprobs_B_T, loss_mask_B_T=loss_mask_B_T)
    loss = reduction.apply(-logprobs_B_T, loss_mask_B_T)
    nll = masked_mean(-logprobs_B_T.detach(), loss_mask_B_T)
    return loss, detached_metrics(nll=nll, num_loss_tokens=(loss_mask_B_T > 0).sum())


def ppo_clip_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    is_weights: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> PPO clipped surrogate max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), dual-clipped at -A c where A < 0."""
    check_same_shape(
        logprobs_B_T=logprobs_B_T,
        old_logprobs_B_T=old_logprobs_B_T,
        advantages_B_T=advantages_B_T,
        mask_B_T=mask_B_T,
        is_weights=is_weights,
    )
    _check_eps(eps_low, eps_high)
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(
            f"dual_clip_c must be > 1 or None (it bounds the loss of negative advantages), got {dual_clip_c!r}"
        )
    logprobs_B_T, old_logprobs_B_T, advantages_B_T = _zero_unselected(
        mask_B_T, logprobs_B_T, old_logprobs_B_T, advantages_B_T
    )
    log_ratio_B_T = torch.clamp(logprobs_B_T - old_logprobs_B_T.detach(), -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio_B_T = torch.exp(log_ratio_B_T)
    adv_B_T = advantages_B_T.detach()
    unclipped_B_T = -adv_B_T * ratio_B_T
    clipped_B_T = -adv_B_T * torch.clamp(ratio_B_T, 1.0 - eps_low, 1.0 + eps_high)
    loss_B_T = torch.maximum(unclipped_B_T, clipped_B_T)
    negative = adv_B_T < 0
    metrics: dict[str, Tensor | float] = {}
    if dual_clip_c is not None:
        loss_B_T = torch.where(negative, torch.minimum(loss_B_T, -adv_B_T * dual_clip_c), loss_B_T)
        metrics["dual_clip_frac"] = masked_mean((negative & (ratio_B_T > dual_clip_c)).float(), mask_B_T)
    loss = reduction.apply(_weighted(loss_B_T, is_weights), mask_B_T)
    ratio = ratio_B_T.detach()
    ratio_min, ratio_max = _masked_extremes(ratio, mask_B_T, empty=1.0)
    return loss, detached_metrics(
        pg_loss=loss,
        clip_frac_low=masked_mean((negative & (ratio < 1.0 - eps_low)).float(), mask_B_T),
        clip_frac_high=masked_mean(((adv_B_T > 0) & (ratio > 1.0 + eps_high)).float(), mask_B_T),
        approx_kl=masked_mean(-log_ratio_B_T.detach(), mask_B_T),
        ratio_mean=masked_mean(ratio, mask_B_T),
        ratio_min=ratio_min,
        ratio_max=ratio_max,
        **metrics,
    )


def gspo_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    is_weights: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> GSPO: PPO clip on the sequence ratio s_i = exp(mean_t log r_t), per token as sg(s_i) r_t / sg(r_t).

    Defaults follow the GSPO paper: clip range (3e-4, 4e-4), sequence-mean aggregation. The log of
    the per-token ratio is clamped above at 10 (verl's GSPO), so its gradient is 0 beyond e^10.
    """
    check_same_shape(
        logprobs_B_T=logprobs_B_T,
        old_logprobs_B_T=old_logprobs_B_T,
        advantages_B_T=advantages_B_T,
        mask_B_T=mask_B_T,
        is_weights=is_weights,
        segment_ids_B_T=reduction.segment_ids_B_T,
    )
    _check_eps(eps_low, eps_high)
    segment_ids_B_T = reduction.segment_ids_B_T
    logprobs_B_T, old_logprobs_B_T, advantages_B_T = _zero_unselected(
        mask_B_T, logprobs_B_T, old_logprobs_B_T, advantages_B_T
    )
    selected_B_T = (mask_B_T > 0).to(logprobs_B_T.dtype)
    token_log_ratio_B_T = (logprobs_B_T - old_logprobs_B_T).detach() * selected_B_T
    seq_log_ratio_S = safe_divide(
        sequence_sums(token_log_ratio_B_T, segment_ids_B_T), sequence_sums(selected_B_T, segment_ids_B_T)
    )
    seq_log_ratio_B_T = to_tokens(seq_log_ratio_S, segment_ids_B_T, logprobs_B_T.shape)
    # value = the sequence ratio; gradient = that of the token's own log-prob, scaled by the ratio
    log_ratio_B_T = seq_log_ratio_B_T + logprobs_B_T - logprobs_B_T.detach()
    ratio_B_T = torch.exp(torch.clamp(log_ratio_B_T, max=GSPO_MAX_LOG_RATIO))
    adv_B_T = advantages_B_T.detach()
    loss_B_T = torch.maximum(-adv_B_T * ratio_B_T, -adv_B_T * torch.clamp(ratio_B_T, 1.0 - eps_low, 1.0 + eps_high))
    # the paper's sequence mean, unless the reduction names a mode
    loss = reduction.apply(_weighted(loss_B_T, is_weights), mask_B_T, "seq-mean-token-mean")
    ratio = ratio_B_T.detach()
    has_tokens_S = (sequence_sums(selected_B_T, segment_ids_B_T) > 0) & sequence_present(mask_B_T, segment_ids_B_T)
    seq_ratio_S = torch.exp(torch.clamp(seq_log_ratio_S, max=GSPO_MAX_LOG_RATIO))
    return loss, detached_metrics(
        pg_loss=loss,
        clip_frac_low=masked_mean(((adv_B_T < 0) & (ratio < 1.0 - eps_low)).float(), mask_B_T),
        clip_frac_high=masked_mean(((adv_B_T > 0) & (ratio > 1.0 + eps_high)).float(), mask_B_T),
        approx_kl=masked_mean(-token_log_ratio_B_T, mask_B_T),
        seq_ratio_mean=safe_divide((seq_ratio_S * has_tokens_S).sum(), has_tokens_S.sum()),
    )


def cispo_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    is_weights: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> CISPO: -sg(clamp(r, 1 - eps_low, 1 + eps_high)) A log p (clip the weight, keep every token's gradient)."""
    check_same_shape(
        logprobs_B_T=logprobs_B_T,
        old_logprobs_B_T=old_logprobs_B_T,
        advantages_B_T=advantages_B_T,
        mask_B_T=mask_B_T,
        is_weights=is_weights,
    )
    _check_eps(eps_low, eps_high)
    logprobs_B_T, old_logprobs_B_T, advantages_B_T = _zero_unselected(
        mask_B_T, logprobs_B_T, old_logprobs_B_T, advantages_B_T
    )
    log_ratio_B_T = torch.clamp((logprobs_B_T - old_logprobs_B_T).detach(), -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio_B_T = torch.exp(log_ratio_B_T)
    weight_B_T = torch.clamp(ratio_B_T, 1.0 - eps_low, 1.0 + eps_high)
    loss_B_T = -weight_B_T * advantages_B_T.detach() * logprobs_B_T
    loss = reduction.apply(_weighted(loss_B_T, is_weights), mask_B_T)
    return loss, detached_metrics(
        pg_loss=loss,
        clip_frac_low=masked_mean((ratio_B_T < 1.0 - eps_low).float(), mask_B_T),
        clip_frac_high=masked_mean((ratio_B_T > 1.0 + eps_high).float(), mask_B_T),
        approx_kl=masked_mean(-log_ratio_B_T, mask_B_T),
        ratio_mean=masked_mean(ratio_B_T, mask_B_T),
    )


def pg_loss(
    logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    is_weights: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> vanilla policy gradient (REINFORCE / on-policy GRPO without a ratio): -A log p."""
    check_same_shape(logprobs_B_T=logprobs_B_T, advantages_B_T=advantages_B_T, mask_B_T=mask_B_T, is_weights=is_weights)
    logprobs_B_T, advantages_B_T = _zero_unselected(mask_B_T, logprobs_B_T, advantages_B_T)
    loss_B_T = -advantages_B_T.detach() * logprobs_B_T
    loss = reduction.apply(_weighted(loss_B_T, is_weights), mask_B_T)
    return loss, detached_metrics(pg_loss=loss)


def value_loss(
    values_B_T: Tensor,
    old_values_B_T: Tensor,
    returns_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    clip_range: float | None = 0.2,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> clipped critic loss 0.5 max((v - R)^2, (v_old + clip(v - v_old, +-clip_range) - R)^2)."""
    check_same_shape(values_B_T=values_B_T, old_values_B_T=old_values_B_T, returns_B_T=returns_B_T, mask_B_T=mask_B_T)
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range must be > 0 or None (no clipping), got {clip_range!r}")
    returns = returns_B_T.detach()
    unclipped_B_T = (values_B_T - returns) ** 2
    loss_B_T = unclipped_B_T
    clip_frac: Tensor | float = 0.0
    if clip_range is not None:
        old = old_values_B_T.detach()
        # Clamp v itself (not old + clamp(v - old)): inside the band the clipped value is exactly v, so
        # rounding in old + (v - old) cannot count an unclipped token as clipped.
        clipped_B_T = (torch.clamp(values_B_T, old - clip_range, old + clip_range) - returns) ** 2
        loss_B_T = torch.maximum(unclipped_B_T, clipped_B_T)
        clip_frac = masked_mean((clipped_B_T > unclipped_B_T).float(), mask_B_T)
    loss = 0.5 * reduction.apply(loss_B_T, mask_B_T)
    return loss, detached_metrics(
        vf_loss=loss, vf_clip_frac=clip_frac, value_mean=masked_mean(values_B_T.detach(), mask_B_T)
    )
