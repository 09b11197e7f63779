"""Policy losses of 2025-26: SAPO, GMPO, DPPO (binary TV and binary KL), Clip-Cov and KL-Cov.

Legend: B rows, T tokens per row, S sequences (on packed rows, bins indexed by segment id).
Every loss takes [B, T] log-probs, old log-probs, advantages and mask, and a `Reduction` as the
losses of `policy.py` do (its mode None: seq-mean-token-mean for SAPO and GMPO, token-mean for the
others); it zeroes masked-out inputs before any arithmetic and returns `(scalar loss, metrics)` (0-dim detached tensors).

Each is written from its paper and checked against a peer's formula (files read on the dates given):
- SAPO (Gao et al. 2025, arXiv 2511.20347): -A f(r), the soft gate f(r) = (4 / tau) sigmoid(tau (r - 1)),
  tau = tau_pos where A > 0, else tau_neg; verl `verl/trainer/ppo/core_algos.py`
  `compute_policy_loss_sapo` (2026-01-29). Departure: verl forces seq-mean-token-mean; here it is
  the default mode, not forced.
- GMPO (Zhao et al. 2025, arXiv 2507.20673): -A_seq exp(mean_t clip(log r_t)), the geometric mean of
  the token ratios, each clipped in log space to [-eps_low, eps_high] on the side the advantage's
  sign makes pessimistic; verl `compute_policy_loss_geo_mean` (same file and date). Departures: the
  sequence length counts tokens with mask > 0 (as our GSPO), the reduction is `aggregate` (default
  seq-mean-token-mean, verl's batch mean of sequences), IS weights multiply per token, and each
  token's log-ratio is clamped to +-20 first (verl's clamp is commented out): with A < 0 nothing else
  bounds the pessimistic log-ratio above, and one token with log r = 200 in a sequence of two would
  overflow exp() to inf in float32 and bf16; the same bound as PPO's, and a token beyond it gets no
  gradient.
- DPPO (Qi et al. 2026, arXiv 2602.04879): -A r on tokens inside a trust region of the sampled
  token's probability, masked (no gradient) outside it when the move agrees with the advantage's
  sign. "tv": p - p_old > eps_high (A > 0) or < -eps_low (A <= 0); "kl": the binary KL
  p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)) above eps_high (p rose, A > 0) or
  eps_low (p fell, A <= 0). prime-rl `src/prime_rl/trainer/rl/loss.py` `default_loss_fn`
  (2026-07-01) and sail-sg/Stable-RL `verl/trainer/ppo/core_algos.py` (2026-03-02).
- Clip-Cov and KL-Cov (Cui et al. 2025, arXiv 2505.22617): the tokens whose covariance
  (A - mean A)(log p - mean log p) is largest drive entropy collapse. Clip-Cov zeroes the loss of
  a random cov_fraction of the tokens with covariance in (low, high) that PPO's clip left alone;
  KL-Cov adds coef |log r| on the top cov_fraction tokens by covariance (the surrogate is unclipped).
  verl `compute_policy_loss_clip_cov` / `compute_policy_loss_kl_cov` (2026-01-29). Both pick among
  this micro-batch's tokens, as verl does; Clip-Cov's options are one `ClipCovPick` (fraction, bounds,
  the draw's generator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rollouts.losses.aggregate import (
    DEFAULT_REDUCTION,
    Reduction,
    check_same_shape,
    masked_mean,
    safe_divide,
    sequence_sums,
    to_tokens,
)
from rollouts.losses.metrics import detached_metrics
from rollouts.losses.policy import MAX_LOG_RATIO, _check_eps, _weighted, _zero_unselected

__all__ = [
    "DEFAULT_CLIP_COV_PICK",
    "ClipCovPick",
    "clip_cov_loss",
    "dppo_loss",
    "gmpo_loss",
    "kl_cov_loss",
    "sapo_loss",
]

BINARY_KL_EPS = 1e-8
"""Added inside log(1 - p) of the binary KL (Stable-RL's 1e-8): a token of probability 1 would give log 0."""
SAPO_GATE_SCALE = 4.0
"""The SAPO gate is (4 / tau) sigmoid(tau (r - 1)): its slope at r = 1 is 1, so near the old policy it is -A r."""


def _log_ratio(logprobs_B_T: Tensor, old_logprobs_B_T: Tensor) -> Tensor:
    """log(pi / pi_old), old detached, clamped to +-MAX_LOG_RATIO before any exp()."""
    return torch.clamp(logprobs_B_T - old_logprobs_B_T.detach(), -MAX_LOG_RATIO, MAX_LOG_RATIO)


def sapo_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    is_weights: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> SAPO: -A (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos where A > 0, else tau_neg."""
    check_same_shape(
        logprobs_B_T=logprobs_B_T,
        old_logprobs_B_T=old_logprobs_B_T,
        advantages_B_T=advantages_B_T,
        mask_B_T=mask_B_T,
        is_weights=is_weights,
    )
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos ({tau_pos!r}) and tau_neg ({tau_neg!r}) must be > 0: the gate divides by them")
    logprobs_B_T, old_logprobs_B_T, advantages_B_T = _zero_unselected(
        mask_B_T, logprobs_B_T, old_logprobs_B_T, advantages_B_T
    )
    log_ratio_B_T = _log_ratio(logprobs_B_T, old_logprobs_B_T)
    ratio_B_T = torch.exp(log_ratio_B_T)
    adv_B_T = advantages_B_T.detach()
    tau_B_T = torch.where(adv_B_T > 0, tau_pos, tau_neg).to(ratio_B_T.dtype)
    gate_B_T = torch.sigmoid(tau_B_T * (ratio_B_T - 1.0)) * (SAPO_GATE_SCALE / tau_B_T)
    # verl's sequence mean, unless the reduction names a mode
    loss = reduction.apply(_weighted(-adv_B_T * gate_B_T, is_weights), mask_B_T, "seq-mean-token-mean")
    return loss, detached_metrics(
        pg_loss=loss,
        approx_kl=masked_mean(-log_ratio_B_T.detach(), mask_B_T),
        ratio_mean=masked_mean(ratio_B_T.detach(), mask_B_T),
        gate_mean=masked_mean(gate_B_T.detach(), mask_B_T),
    )


def gmpo_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
    is_weights: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> GMPO: -mean_t(A) exp(mean_t sgn(A) min(sgn(A) log r, sgn(A) clip(log r, -eps_low, eps_high))),
    per sequence, on every token of it. eps are log-space bounds (the paper's 0.4: ratios in (e^-0.4, e^0.4)).
    Each token's log r is clamped to +-20 before anything else, where verl has no clamp, so one far-off
    token cannot overflow its sequence's ratio."""
    check_same_shape(
        logprobs_B_T=logprobs_B_T,
        old_logprobs_B_T=old_logprobs_B_T,
        advantages_B_T=advantages_B_T,
        mask_B_T=mask_B_T,
        is_weights=is_weights,
        segment_ids_B_T=reduction.segment_ids_B_T,
    )
    if not (eps_low >= 0 and eps_high >= 0):
        raise ValueError(f"eps_low ({eps_low!r}) and eps_high ({eps_high!r}) must be >= 0 (log-ratio clip bounds)")
    segment_ids_B_T = reduction.segment_ids_B_T
    logprobs_B_T, old_logprobs_B_T, advantages_B_T = _zero_unselected(
        mask_B_T, logprobs_B_T, old_logprobs_B_T, advantages_B_T
    )
    selected_B_T = (mask_B_T > 0).to(logprobs_B_T.dtype)
    log_ratio_B_T = _log_ratio(logprobs_B_T, old_logprobs_B_T)
    adv_B_T = advantages_B_T.detach()
    sign_B_T = torch.sign(adv_B_T)
    clipped_B_T = torch.clamp(log_ratio_B_T, -eps_low, eps_high)
    pessimistic_B_T = sign_B_T * torch.minimum(sign_B_T * log_ratio_B_T, sign_B_T * clipped_B_T)
    length_S = sequence_sums(selected_B_T, segment_ids_B_T)
    seq_log_ratio_S = safe_divide(sequence_sums(pessimistic_B_T * selected_B_T, segment_ids_B_T), length_S)
    seq_adv_S = safe_divide(sequence_sums(adv_B_T * selected_B_T, segment_ids_B_T), length_S)
    loss_S = -seq_adv_S * torch.exp(seq_log_ratio_S)
    loss_B_T = to_tokens(loss_S, segment_ids_B_T, logprobs_B_T.shape)
    # verl's batch mean of sequences, unless the reduction names a mode
    loss = reduction.apply(_weighted(loss_B_T, is_weights), mask_B_T, "seq-mean-token-mean")
    was_clipped_B_T = (log_ratio_B_T != clipped_B_T).detach()
    return loss, detached_metrics(
        pg_loss=loss,
        clip_frac_low=masked_mean((was_clipped_B_T & (adv_B_T < 0)).float(), mask_B_T),
        clip_frac_high=masked_mean((was_clipped_B_T & (adv_B_T > 0)).float(), mask_B_T),
        approx_kl=masked_mean(-log_ratio_B_T.detach(), mask_B_T),
    )


def dppo_mask(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    *,
    divergence: Literal["tv", "kl"],
    eps_low: float,
    eps_high: float,
) -> Tensor:
    """[B, T] bool: tokens outside DPPO's trust region in the direction of their advantage (no gradient there)."""
    with torch.no_grad():
        # a log-prob above 0 (an engine's rounding) would give a probability above 1 and a NaN binary KL
        logprobs_B_T, old_logprobs_B_T = logprobs_B_T.clamp(max=0.0), old_logprobs_B_T.clamp(max=0.0)
        p_B_T, p_old_B_T = torch.exp(logprobs_B_T), torch.exp(old_logprobs_B_T)
        if divergence == "tv":
            rose_B_T = p_B_T - p_old_B_T > eps_high
            fell_B_T = p_B_T - p_old_B_T < -eps_low
        elif divergence == "kl":
            binary_kl_B_T = p_old_B_T * (old_logprobs_B_T - logprobs_B_T) + (1.0 - p_old_B_T) * torch.log(
                (1.0 - p_old_B_T + BINARY_KL_EPS) / (1.0 - p_B_T + BINARY_KL_EPS)
            )
            rose_B_T = (binary_kl_B_T > eps_high) & (p_B_T > p_old_B_T)
            fell_B_T = (binary_kl_B_T > eps_low) & (p_B_T < p_old_B_T)
        else:
            raise ValueError(f"divergence must be 'tv' or 'kl', got {divergence!r}")
        return torch.where(advantages_B_T > 0, rose_B_T, fell_B_T)


def dppo_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    divergence: Literal["tv", "kl"] = "tv",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    is_weights: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> DPPO: -A r on tokens inside the trust region (binary TV or binary KL to pi_old), 0 outside.

    The masked tokens stay in the denominators (a trust-region mask, like PPO's clip, not a filter).
    """
    check_same_shape(
        logprobs_B_T=logprobs_B_T,
        old_logprobs_B_T=old_logprobs_B_T,
        advantages_B_T=advantages_B_T,
        mask_B_T=mask_B_T,
        is_weights=is_weights,
    )
    if not (eps_low >= 0 and eps_high >= 0):
        raise ValueError(f"eps_low ({eps_low!r}) and eps_high ({eps_high!r}) must be >= 0 (divergence thresholds)")
    logprobs_B_T, old_logprobs_B_T, advantages_B_T = _zero_unselected(
        mask_B_T, logprobs_B_T, old_logprobs_B_T, advantages_B_T
    )
    adv_B_T = advantages_B_T.detach()
    old_B_T = old_logprobs_B_T.detach()
    outside_B_T = dppo_mask(logprobs_B_T, old_B_T, adv_B_T, divergence=divergence, eps_low=eps_low, eps_high=eps_high)
    log_ratio_B_T = _log_ratio(logprobs_B_T, old_B_T)
    ratio_B_T = torch.exp(log_ratio_B_T)
    loss_B_T = torch.where(outside_B_T, 0.0, -adv_B_T * ratio_B_T)
    loss = reduction.apply(_weighted(loss_B_T, is_weights), mask_B_T)
    return loss, detached_metrics(
        pg_loss=loss,
        masked_frac_high=masked_mean((outside_B_T & (adv_B_T > 0)).float(), mask_B_T),
        masked_frac_low=masked_mean((outside_B_T & (adv_B_T <= 0)).float(), mask_B_T),
        approx_kl=masked_mean(-log_ratio_B_T.detach(), mask_B_T),
        ratio_mean=masked_mean(ratio_B_T.detach(), mask_B_T),
    )


def token_covariance(logprobs_B_T: Tensor, advantages_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """[B, T] (A - mean A)(log p - mean log p), means over tokens with mask > 0, detached; 0 off the mask."""
    selected_B_T = mask_B_T > 0
    logprobs_B_T, advantages_B_T = logprobs_B_T.detach(), advantages_B_T.detach()
    cov_B_T = (advantages_B_T - masked_mean(advantages_B_T, mask_B_T)) * (
        logprobs_B_T - masked_mean(logprobs_B_T, mask_B_T)
    )
    return torch.where(selected_B_T, cov_B_T, 0.0)


def _num_picked(mask_B_T: Tensor, fraction: float) -> Tensor:
    """0-dim int64: max(1, floor(fraction x loss tokens)), as verl; 0 when there are no loss tokens.
    A device count, never read on the host."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"cov_fraction must be in (0, 1] (a fraction of the loss tokens), got {fraction!r}")
    num_selected = (mask_B_T > 0).sum()
    # float64, as Python's int(fraction * n): a float32 product could round across an integer
    wanted = torch.floor(num_selected.double() * fraction).long().clamp(min=1)
    return torch.where(num_selected > 0, wanted, 0)


def _top_k_mask(scores_B_T: Tensor, eligible_B_T: Tensor, k: Tensor) -> Tensor:
    """[B, T] bool: the (at most) k eligible positions with the largest scores; k a 0-dim device count.

    A fixed-shape top-k: a stable sort of every position by score, then the first k eligible ones in
    that order, so nothing waits for k on the host. Among tied scores the earlier position wins.
    """
    scores_N, eligible_N = scores_B_T.reshape(-1), eligible_B_T.reshape(-1)
    order_N = torch.sort(torch.where(eligible_N, scores_N, -torch.inf), descending=True, stable=True).indices
    eligible_sorted_N = eligible_N[order_N]
    # the rank of each eligible position among the eligible ones, 1-based, in score order
    picked_sorted_N = eligible_sorted_N & (torch.cumsum(eligible_sorted_N, 0) <= k)
    return torch.zeros_like(eligible_N).scatter(0, order_N, picked_sorted_N).reshape(scores_B_T.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClipCovPick:
    """Which tokens Clip-Cov detaches: a random cov_fraction of the unclipped loss tokens whose covariance
    lies in cov_bounds, drawn from generator. Checked by `clip_cov_loss`."""

    cov_fraction: float = 2e-4
    """The fraction of the loss tokens to pick, in (0, 1] (at least one token when there are any)."""
    cov_bounds: tuple[float, float] = (1.0, 5.0)
    """(low, high): a token is eligible when low < covariance < high."""
    generator: torch.Generator | None = None
    """The random draw's generator (None: torch's global RNG). On another device than the loss's tensors,
    the draws are copied over, and a copy from the host waits for the device: give one on their device."""


DEFAULT_CLIP_COV_PICK = ClipCovPick()
"""verl's defaults: 2e-4 of the tokens, covariance in (1, 5), torch's global RNG."""


def clip_cov_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    pick: ClipCovPick = DEFAULT_CLIP_COV_PICK,
    is_weights: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> PPO clip, with the loss of a random pick.cov_fraction of unclipped tokens whose covariance lies
    in pick.cov_bounds set to 0 (their gradient detached)."""
    check_same_shape(
        logprobs_B_T=logprobs_B_T,
        old_logprobs_B_T=old_logprobs_B_T,
        advantages_B_T=advantages_B_T,
        mask_B_T=mask_B_T,
        is_weights=is_weights,
    )
    _check_eps(eps_low, eps_high)
    cov_bounds, generator = pick.cov_bounds, pick.generator
    if not cov_bounds[0] < cov_bounds[1]:
        raise ValueError(f"cov_bounds must be (low, high) with low < high, got {cov_bounds!r}")
    logprobs_B_T, old_logprobs_B_T, advantages_B_T = _zero_unselected(
        mask_B_T, logprobs_B_T, old_logprobs_B_T, advantages_B_T
    )
    adv_B_T = advantages_B_T.detach()
    ratio_B_T = torch.exp(_log_ratio(logprobs_B_T, old_logprobs_B_T))
    unclipped_B_T = -adv_B_T * ratio_B_T
    clipped_B_T = -adv_B_T * torch.clamp(ratio_B_T, 1.0 - eps_low, 1.0 + eps_high)
    cov_B_T = token_covariance(logprobs_B_T, adv_B_T, mask_B_T)
    eligible_B_T = (
        (mask_B_T > 0) & ~(clipped_B_T > unclipped_B_T) & (cov_B_T > cov_bounds[0]) & (cov_B_T < cov_bounds[1])
    ).detach()
    draw_device = generator.device if generator is not None else mask_B_T.device
    draws_B_T = torch.rand(mask_B_T.shape, generator=generator, device=draw_device).to(mask_B_T.device)
    picked_B_T = _top_k_mask(draws_B_T, eligible_B_T, _num_picked(mask_B_T, pick.cov_fraction))
    loss_B_T = torch.where(picked_B_T, 0.0, torch.maximum(unclipped_B_T, clipped_B_T))
    loss = reduction.apply(_weighted(loss_B_T, is_weights), mask_B_T)
    return loss, detached_metrics(
        pg_loss=loss,
        cov_picked_frac=masked_mean(picked_B_T.float(), mask_B_T),
        approx_kl=masked_mean(-_log_ratio(logprobs_B_T, old_logprobs_B_T).detach(), mask_B_T),
    )


def kl_cov_loss(
    logprobs_B_T: Tensor,
    old_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    cov_fraction: float = 2e-4,
    kl_coef: float = 1.0,
    is_weights: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> -A r, plus kl_coef |log r| on the top cov_fraction of loss tokens by covariance."""
    check_same_shape(
        logprobs_B_T=logprobs_B_T,
        old_logprobs_B_T=old_logprobs_B_T,
        advantages_B_T=advantages_B_T,
        mask_B_T=mask_B_T,
        is_weights=is_weights,
    )
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
    logprobs_B_T, old_logprobs_B_T, advantages_B_T = _zero_unselected(
        mask_B_T, logprobs_B_T, old_logprobs_B_T, advantages_B_T
    )
    adv_B_T = advantages_B_T.detach()
    log_ratio_B_T = _log_ratio(logprobs_B_T, old_logprobs_B_T)
    cov_B_T = token_covariance(logprobs_B_T, adv_B_T, mask_B_T)
    picked_B_T = _top_k_mask(cov_B_T, mask_B_T > 0, _num_picked(mask_B_T, cov_fraction))
    loss_B_T = -adv_B_T * torch.exp(log_ratio_B_T) + torch.where(picked_B_T, kl_coef * log_ratio_B_T.abs(), 0.0)
    loss = reduction.apply(_weighted(loss_B_T, is_weights), mask_B_T)
    return loss, detached_metrics(
        pg_loss=loss,
        cov_picked_frac=masked_mean(picked_B_T.float(), mask_B_T),
        approx_kl=masked_mean(-log_ratio_B_T.detach(), mask_B_T),
    )
