"""Rollout correction: rejection masks, TRL's off-policy sequence mask, the high-entropy token mask,
and the off-policy diagnostics between the inference engine and the trainer.

Legend: B rows, T tokens per row, S sequences (on packed rows, bins indexed by segment id).
"old" log-probs are the trainer's for the sampled tokens, "rollout" log-probs the engine's;
log r = old - rollout (clamped to +-20 before exp()). Every mask is [B, T], 0 off the loss mask,
and is meant to multiply the per-token loss (as IS weights do): rejected tokens stay in the
denominators, so step-wide token and sequence counts keep meaning the same thing.

From verl `verl/trainer/ppo/rollout_corr_helper.py` (read 2026-01-29):
- `rejection_mask`: verl's `compute_rollout_rejection_mask`, one rule at a time. Statistics
  k1 = -log r (verl's token_k1), k2 = 0.5 log^2 r, k3 = r - 1 - log r, per token or reduced
  per sequence by sum, mean or max. Departures: both bounds apply to every estimator (verl bounds
  k2/k3 above only), and k1's bounds are on k1 itself, not on a ratio (verl's "0.5_2.0" for k1 is
  rs_low=log(0.5), rs_high=log(2.0)); rejected tokens keep their place in the denominator (verl
  removes them from the response mask).
- `off_policy_diagnostics`: verl's `compute_offpolicy_metrics` and the ESS of `compute_is_metrics`:
  KL(engine || trainer) by k1 and k3, |log-prob drift|, log-perplexity difference, chi-square at
  token and sequence level (E[w^2] - 1), and the effective sample size (sum w)^2 / (n sum w^2) of
  token and sequence weights (a fraction in (0, 1]; 1 = on-policy). Departures, kept on purpose:
  the log-perplexity difference and the sequence chi-square average over the sequences that have
  loss tokens (verl averages over all rows, so a fully masked row, e.g. an overlong-filtered sample,
  counts as a perfect match and pulls both toward 0: two empty rows of eight shrink verl's log-ppl
  difference by 6/8); the ESS uses the raw weights (verl clamps them to [1/threshold, threshold]
  first, to avoid overflow: here they are float64 with log w clamped to +-20, which cannot overflow,
  and a clamped ESS stops at the band, hiding how far the engine has drifted; the diagnostics have
  no IS threshold, being computed whether or not IS is on); and the sequence ESS counts each
  sequence once, the sequence being the sample its weight belongs to (verl's mean over tokens
  counts a sequence once per token, so long sequences weigh more).
From TRL `trl/trainer/grpo_trainer.py` (read 2026-07-24):
- `off_policy_sequence_mask` (`get_off_policy_mask`, DeepSeek-V3.2 eq. 9): keep a sequence if its
  advantage is >= 0 or its mean log(pi_rollout / pi) is <= threshold. Departure: the sequence's
  advantage is the mean over its loss tokens (TRL has one advantage per sequence).
- `high_entropy_mask` (`get_high_entropy_mask`, "Beyond the 80/20 Rule"): keep tokens whose entropy
  is >= the (1 - top_quantile) quantile. Departure: the quantile is over this micro-batch's loss
  tokens (TRL gathers it over the step's processes).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rollouts.losses.aggregate import check_same_shape, masked_mean, safe_divide, sequence_sums, to_tokens
from rollouts.losses.metrics import detached_metrics

__all__ = ["high_entropy_mask", "off_policy_diagnostics", "off_policy_sequence_mask", "rejection_mask"]

MAX_CORRECTION_LOG_RATIO = 20.0
"""Clamp on log r (and a sequence's sum of them) before exp(): verl's SAFETY_BOUND, so w^2 fits float32."""
REJECTION_ESTIMATORS = ("k1", "k2", "k3")
REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")


def _log_ratio(old_logprobs_B_T: Tensor, rollout_logprobs_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """[B, T] clamped log(pi_old / pi_rollout), detached, 0 off the mask (a -inf there never enters)."""
    selected_B_T = mask_B_T > 0
    diff_B_T = torch.where(selected_B_T, old_logprobs_B_T.detach(), 0.0) - torch.where(
        selected_B_T, rollout_logprobs_B_T.detach(), 0.0
    )
    return torch.clamp(diff_B_T, -MAX_CORRECTION_LOG_RATIO, MAX_CORRECTION_LOG_RATIO)


def _sequence_max(x_B_T: Tensor, mask_B_T: Tensor, segment_ids_B_T: Tensor | None) -> Tensor:
    """[S] max of x over each sequence's tokens with mask > 0 (-inf for a sequence without any)."""
    values_N = torch.where(mask_B_T > 0, x_B_T, -torch.inf).reshape(-1)
    num_bins = x_B_T.numel() if segment_ids_B_T is not None else x_B_T.shape[0]  # as sequence_sums
    if segment_ids_B_T is None:  # one sequence per row: the row index is its segment id
        segment_ids_B_T = torch.arange(x_B_T.shape[0], device=x_B_T.device)[:, None].expand(x_B_T.shape)
    seg_N = segment_ids_B_T.reshape(-1)
    values_N = torch.where(seg_N >= 0, values_N, -torch.inf)
    out_S = torch.full((num_bins,), -torch.inf, dtype=x_B_T.dtype, device=x_B_T.device)
    return out_S.scatter_reduce(0, seg_N.clamp(min=0), values_N, reduce="amax")


def rejection_mask(
    old_logprobs_B_T: Tensor,
    rollout_logprobs_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    estimator: Literal["k1", "k2", "k3"],
    level: Literal["token", "seq_sum", "seq_mean", "seq_max"],
    low: float | None = None,
    high: float | None = None,
    segment_ids_B_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] trainer and engine log-probs -> ([B, T] float keep mask, 1 where low <= statistic <= high; metrics)."""
    check_same_shape(
        old_logprobs_B_T=old_logprobs_B_T,
        rollout_logprobs_B_T=rollout_logprobs_B_T,
        mask_B_T=mask_B_T,
        segment_ids_B_T=segment_ids_B_T,
    )
    if estimator not in REJECTION_ESTIMATORS:
        raise ValueError(f"estimator must be one of {REJECTION_ESTIMATORS}, got {estimator!r}")
    if level not in REJECTION_LEVELS:
        raise ValueError(f"level must be one of {REJECTION_LEVELS}, got {level!r}")
    if low is None and high is None:
        raise ValueError("rejection_mask needs low or high (a rule without a bound rejects nothing)")
    if low is not None and high is not None and not low < high:
        raise ValueError(f"low ({low!r}) must be < high ({high!r})")
    selected_B_T = mask_B_T > 0
    log_r_B_T = _log_ratio(old_logprobs_B_T, rollout_logprobs_B_T, mask_B_T)
    token_stats = {"k1": -log_r_B_T, "k2": 0.5 * log_r_B_T.square(), "k3": torch.expm1(log_r_B_T) - log_r_B_T}
    stat_B_T = token_stats[estimator]
    if level != "token":
        count_S = sequence_sums(selected_B_T.to(stat_B_T.dtype), segment_ids_B_T)
        if level == "seq_max":
            stat_S = _sequence_max(stat_B_T, mask_B_T, segment_ids_B_T)
        else:
            stat_S = sequence_sums(torch.where(selected_B_T, stat_B_T, 0.0), segment_ids_B_T)
            stat_S = safe_divide(stat_S, count_S) if level == "seq_mean" else stat_S
        stat_B_T = to_tokens(stat_S, segment_ids_B_T, stat_B_T.shape)
    keep_B_T = selected_B_T.clone()
    if low is not None:
        keep_B_T &= stat_B_T >= low
    if high is not None:
        keep_B_T &= stat_B_T <= high
    rejected_B_T = (selected_B_T & ~keep_B_T).to(stat_B_T.dtype)
    count_S = sequence_sums(selected_B_T.to(stat_B_T.dtype), segment_ids_B_T)
    rejected_seq_S = sequence_sums(rejected_B_T, segment_ids_B_T) > 0
    return keep_B_T.to(old_logprobs_B_T.dtype), detached_metrics(
        rs_masked_frac=masked_mean(rejected_B_T, mask_B_T),
        rs_seq_masked_frac=safe_divide(rejected_seq_S.sum().to(stat_B_T.dtype), (count_S > 0).sum().to(stat_B_T.dtype)),
        rs_stat_mean=masked_mean(stat_B_T, mask_B_T),
    )


def off_policy_sequence_mask(
    logprobs_B_T: Tensor,
    rollout_logprobs_B_T: Tensor,
    advantages_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    threshold: float,
    segment_ids_B_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] -> ([B, T] float keep mask: 0 on sequences with mean advantage < 0 and mean
    log(pi_rollout / pi) > threshold; metrics)."""
    check_same_shape(
        logprobs_B_T=logprobs_B_T,
        rollout_logprobs_B_T=rollout_logprobs_B_T,
        advantages_B_T=advantages_B_T,
        mask_B_T=mask_B_T,
        segment_ids_B_T=segment_ids_B_T,
    )
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0 (a mean KL estimate is compared to it), got {threshold!r}")
    selected_B_T = mask_B_T > 0
    selected_f_B_T = selected_B_T.to(logprobs_B_T.dtype)
    kl_B_T = -_log_ratio(logprobs_B_T, rollout_logprobs_B_T, mask_B_T)
    count_S = sequence_sums(selected_f_B_T, segment_ids_B_T)
    seq_kl_S = safe_divide(sequence_sums(kl_B_T, segment_ids_B_T), count_S)
    seq_adv_S = safe_divide(
        sequence_sums(torch.where(selected_B_T, advantages_B_T.detach(), 0.0), segment_ids_B_T), count_S
    )
    drop_S = (seq_adv_S < 0) & (seq_kl_S > threshold)
    keep_B_T = selected_B_T & ~to_tokens(drop_S, segment_ids_B_T, mask_B_T.shape).bool()
    return keep_B_T.to(logprobs_B_T.dtype), detached_metrics(
        off_policy_masked_frac=masked_mean((~keep_B_T).float(), mask_B_T),
        off_policy_seq_kl_mean=safe_divide((seq_kl_S * (count_S > 0)).sum(), (count_S > 0).sum().to(seq_kl_S.dtype)),
    )


def _masked_quantile(x_N: Tensor, selected_N: Tensor, q: float) -> Tensor:
    """0-dim: torch.quantile(x_N[selected_N], q) (linear interpolation), without the data-dependent shape.

    torch.quantile's own steps on a sort of every entry, the unselected ones set to +inf so the
    selected come first: q rounded to x's dtype, rank = q x (n - 1) in float64, lerp (in x's dtype)
    between the entries at floor and ceil of the rank; NaN when a selected entry is NaN, and when
    nothing is selected (the lerp of +inf and +inf).
    """
    sorted_N = torch.sort(torch.where(selected_N, x_N, torch.inf)).values
    last = (selected_N.sum() - 1).clamp(min=0)
    rank = torch.full((), q, dtype=x_N.dtype, device=x_N.device).double() * last
    below = rank.long()
    # index_select with a 1-d index: indexing by a 0-dim integer tensor reads it on the host
    low, high = sorted_N.index_select(0, torch.stack([below, rank.ceil().long()])).unbind()
    value = torch.lerp(low, high, (rank - below).to(x_N.dtype))
    return torch.where((selected_N & x_N.isnan()).any(), torch.nan, value)


def high_entropy_mask(entropy_B_T: Tensor, mask_B_T: Tensor, *, top_quantile: float) -> Tensor:
    """[B, T] entropy -> [B, T] float mask of loss tokens whose entropy is >= the (1 - top_quantile) quantile."""
    check_same_shape(entropy_B_T=entropy_B_T, mask_B_T=mask_B_T)
    if not 0.0 < top_quantile <= 1.0:
        raise ValueError(f"top_quantile must be in (0, 1] (the fraction of tokens kept), got {top_quantile!r}")
    selected_B_T = mask_B_T > 0
    entropy_B_T = entropy_B_T.detach()
    if entropy_B_T.numel() == 0:
        return torch.zeros_like(mask_B_T, dtype=entropy_B_T.dtype)
    # float32, as torch.quantile of the float32 entropies; without loss tokens the threshold is NaN and
    # keeps nothing, as nothing is selected
    threshold = _masked_quantile(entropy_B_T.float().reshape(-1), selected_B_T.reshape(-1), 1.0 - top_quantile)
    return (selected_B_T & (entropy_B_T.float() >= threshold)).to(entropy_B_T.dtype)


def _ess(weights: Tensor, present: Tensor) -> Tensor:
    """(sum w)^2 / (n sum w^2) over the present entries, in float64; 1 when there are none."""
    w = torch.where(present, weights.double(), 0.0)
    n = present.sum().double()
    return torch.where(n > 0, safe_divide(w.sum().square(), n * w.square().sum()), 1.0)


def off_policy_diagnostics(
    old_logprobs_B_T: Tensor,
    rollout_logprobs_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    segment_ids_B_T: Tensor | None = None,
) -> dict[str, Tensor]:
    """[B, T] trainer and engine log-probs -> metrics (0-dim tensors) of how far the engine's sampling policy is from the trainer's.

    Means over sequences count the sequences with loss tokens; the ESS is of the raw weights, each
    sequence counted once at sequence level (departures from verl, kept: see the module docstring).
    """
    check_same_shape(
        old_logprobs_B_T=old_logprobs_B_T,
        rollout_logprobs_B_T=rollout_logprobs_B_T,
        mask_B_T=mask_B_T,
        segment_ids_B_T=segment_ids_B_T,
    )
    selected_B_T = mask_B_T > 0
    log_r_B_T = _log_ratio(old_logprobs_B_T, rollout_logprobs_B_T, mask_B_T).double()
    w_B_T = torch.exp(log_r_B_T)
    count_S = sequence_sums(selected_B_T.double(), segment_ids_B_T)
    has_tokens_S = count_S > 0
    num_seqs = has_tokens_S.sum().double()
    seq_log_w_S = torch.clamp(
        sequence_sums(log_r_B_T, segment_ids_B_T), -MAX_CORRECTION_LOG_RATIO, MAX_CORRECTION_LOG_RATIO
    )
    seq_w_S = torch.exp(seq_log_w_S)
    # log-perplexity difference per sequence: mean engine log-prob - mean trainer log-prob = -mean log r
    log_ppl_diff_S = safe_divide(-sequence_sums(log_r_B_T, segment_ids_B_T), count_S)
    drift_B_T = torch.where(selected_B_T, log_r_B_T.abs(), 0.0)
    return detached_metrics(
        offpolicy_kl_k1=masked_mean(-log_r_B_T, mask_B_T),
        offpolicy_kl_k3=masked_mean(torch.expm1(log_r_B_T) - log_r_B_T, mask_B_T),
        offpolicy_logprob_abs_diff=masked_mean(drift_B_T, mask_B_T),
        offpolicy_logprob_abs_diff_max=drift_B_T.max() if drift_B_T.numel() else 0.0,
        offpolicy_log_ppl_diff=safe_divide((log_ppl_diff_S * has_tokens_S).sum(), num_seqs),
        offpolicy_chi2_token=masked_mean(w_B_T.square(), mask_B_T) - selected_B_T.any().double(),
        offpolicy_chi2_seq=safe_divide((seq_w_S.square() * has_tokens_S).sum(), num_seqs) - (num_seqs > 0).double(),
        offpolicy_ess_token=_ess(w_B_T, selected_B_T),
        offpolicy_ess_seq=_ess(seq_w_S, has_tokens_S),
    )
