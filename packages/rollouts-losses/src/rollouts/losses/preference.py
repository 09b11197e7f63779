"""Offline preference losses on per-sequence log-probs: DPO, robust DPO, IPO, hinge, SimPO, ORPO, KTO.

Legend: P preference pairs. Every input is [P]: the summed log-prob of a completion's tokens (under
the policy, or under the frozen reference where the loss uses one) or, where the loss averages, the
completion's token count. Each loss returns `(scalar loss, metrics)`; the metrics are TRL's logged
ones (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected; ORPO adds nll_loss, log_odds_ratio, log_odds_chosen; KTO adds kl), as floats.

With d = (pi_c - ref_c) - (pi_r - ref_r) (policy minus reference, chosen minus rejected), z = beta d,
s the sigmoid and e = label_smoothing (TRL's DPOTrainer, CPOTrainer, ORPOTrainer, KTOTrainer):
  sigmoid  -(1 - e) log s(z) - e log s(-z)                  DPO; e > 0: conservative DPO (cDPO)
  robust   [-(1 - e) log s(z) + e log s(-z)] / (1 - 2 e)     robust DPO: unbiased under a fraction e of flipped labels
  hinge    max(0, 1 - z)                                     RSO / SLiC
  ipo      (d' - 1 / (2 beta))^2, d' as d on log-ratios averaged per completion token
  simpo    the sigmoid form on z = beta (pi_c / n_c - pi_r / n_r) - gamma       (no reference)
  orpo     -pi_c / n_c - beta log s(log odds(pi_c / n_c) - log odds(pi_r / n_r)),
           log odds(x) = x - log(1 - e^x); its NLL is TRL's token mean over the chosen tokens  (no reference)
  kto      mean over both of w_d (1 - s(beta (pi_c - ref_c - kl))) and w_u (1 - s(beta (kl - (pi_r - ref_r))))
Rewards: beta (pi - ref); for SimPO and ORPO beta pi / n (their log-probs are per-token means).
A pair's accuracy is its chosen reward strictly above its rejected one (TRL's rule: a tie is wrong).

The losses are means over pairs; `num_pairs` (and for ORPO `num_chosen_tokens`) are the counts of
a whole optimizer step, so the losses of a step's micro-batches, each backpropagated, add up to
the loss of the step as one batch. An empty batch (P = 0) gives loss 0, not NaN.

Departures from TRL: KTO without a given `kl` estimates its reference point from the batch's own
pairs (the mean of every log-ratio, detached, clamped at 0), where TRL's KTOTrainer scores
mismatched (prompt, completion) pairs in extra forward passes; pass `kl` to use such an estimate.
ORPO's average log-probs are clamped just below 0 before log(1 - e^x), where a completion of
probability 1 would give -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rollouts.losses.aggregate import safe_divide
from rollouts.losses.metrics import detached_metrics
from rollouts.types.preference import PreferenceConfig

__all__ = [
    "PairLogps",
    "dpo_loss",
    "hinge_loss",
    "ipo_loss",
    "kto_loss",
    "orpo_loss",
    "preference_loss",
    "robust_dpo_loss",
    "simpo_loss",
]

ORPO_MAX_AVG_LOGP = -1e-6
"""Clamp on ORPO's per-token mean log-prob before log(1 - e^x): at 0 (probability 1) the odds are infinite."""
_LOG_HALF = -0.6931471805599453  # log(1/2): log1mexp switches formula here to avoid cancellation


@dataclass(frozen=True, slots=True, kw_only=True)
class PairLogps:
    """Per-sequence log-probs of P preference pairs, as `preference_loss` takes them."""

    chosen_P: Tensor
    """[P] policy: summed log-prob of each chosen completion's tokens."""
    rejected_P: Tensor
    """[P] policy: summed log-prob of each rejected completion's tokens."""
    chosen_tokens_P: Tensor
    """[P] number of tokens of each chosen completion."""
    rejected_tokens_P: Tensor
    """[P] number of tokens of each rejected completion."""
    ref_chosen_P: Tensor | None = None
    """[P] the same sums under the reference model (None for SimPO and ORPO)."""
    ref_rejected_P: Tensor | None = None
    """[P] the same sums under the reference model (None for SimPO and ORPO)."""


def _check_pairs(**tensors: Tensor | None) -> None:
    """Raise unless every given tensor is a floating [P] tensor of one shared shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    first = next(iter(shapes.values()))
    if len(first) != 1 or any(s != first for s in shapes.values()):
        raise ValueError(f"per-pair tensors must all be [P] with one shape, got {shapes}")
    for name, t in tensors.items():
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor (log-probs or token counts), got {t.dtype}")


def _check_beta(beta: float) -> None:
    if not (isinstance(beta, int | float) and beta > 0 and beta < float("inf")):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")


def _check_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"label_smoothing must be in [0, 0.5) (a fraction of flipped labels below half), got {label_smoothing!r}"
        )


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a non-negative int (a count for the whole step) or None, got {value!r}")


def _mean(losses_N: Tensor, count: int | None) -> Tensor:
    """Sum of the losses over `count` (None: their own number); 0 for no losses."""
    return safe_divide(losses_N.sum(), losses_N.numel() if count is None else count)


def _reward_metrics(
    chosen_rewards_P: Tensor, rejected_rewards_P: Tensor, chosen_logps_P: Tensor, rejected_logps_P: Tensor
) -> dict[str, Tensor | float]:
    """TRL's logged metrics: mean rewards, accuracy (chosen strictly above), margin, mean log-probs."""
    chosen, rejected = chosen_rewards_P.detach(), rejected_rewards_P.detach()

    def mean(x: Tensor) -> Tensor:
        return safe_divide(x.sum(), x.numel())

    return {
        "rewards/chosen": mean(chosen),
        "rewards/rejected": mean(rejected),
        "rewards/accuracies": mean((chosen > rejected).to(chosen.dtype)),
        "rewards/margins": mean(chosen - rejected),
        "logps/chosen": mean(chosen_logps_P.detach()),
        "logps/rejected": mean(rejected_logps_P.detach()),
    }


def _log_ratios(
    chosen_P: Tensor, rejected_P: Tensor, ref_chosen_P: Tensor, ref_rejected_P: Tensor
) -> tuple[Tensor, Tensor]:
    """(pi_c - ref_c, pi_r - ref_r), the reference never differentiated."""
    _check_pairs(chosen_P=chosen_P, rejected_P=rejected_P, ref_chosen_P=ref_chosen_P, ref_rejected_P=ref_rejected_P)
    return chosen_P - ref_chosen_P.detach(), rejected_P - ref_rejected_P.detach()


def _smoothed_sigmoid(z_P: Tensor, label_smoothing: float) -> Tensor:
    """-(1 - e) log s(z) - e log s(-z): the logistic loss against a soft label 1 - e."""
    return -(1.0 - label_smoothing) * F.logsigmoid(z_P) - label_smoothing * F.logsigmoid(-z_P)


def dpo_loss(
    chosen_P: Tensor,
    rejected_P: Tensor,
    ref_chosen_P: Tensor,
    ref_rejected_P: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    num_pairs: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[P] summed log-probs -> DPO's -log s(beta d); label_smoothing e > 0: conservative DPO."""
    _check_beta(beta)
    _check_smoothing(label_smoothing)
    _check_count("num_pairs", num_pairs)
    chosen_ratio_P, rejected_ratio_P = _log_ratios(chosen_P, rejected_P, ref_chosen_P, ref_rejected_P)
    losses_P = _smoothed_sigmoid(beta * (chosen_ratio_P - rejected_ratio_P), label_smoothing)
    loss = _mean(losses_P, num_pairs)
    metrics = _reward_metrics(beta * chosen_ratio_P, beta * rejected_ratio_P, chosen_P, rejected_P)
    return loss, detached_metrics(**metrics)


def robust_dpo_loss(
    chosen_P: Tensor,
    rejected_P: Tensor,
    ref_chosen_P: Tensor,
    ref_rejected_P: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    num_pairs: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[P] summed log-probs -> robust DPO: [-(1 - e) log s(z) + e log s(-z)] / (1 - 2 e), z = beta d."""
    _check_beta(beta)
    _check_smoothing(label_smoothing)
    _check_count("num_pairs", num_pairs)
    chosen_ratio_P, rejected_ratio_P = _log_ratios(chosen_P, rejected_P, ref_chosen_P, ref_rejected_P)
    z_P = beta * (chosen_ratio_P - rejected_ratio_P)
    e = label_smoothing
    losses_P = (-(1.0 - e) * F.logsigmoid(z_P) + e * F.logsigmoid(-z_P)) / (1.0 - 2.0 * e)
    loss = _mean(losses_P, num_pairs)
    metrics = _reward_metrics(beta * chosen_ratio_P, beta * rejected_ratio_P, chosen_P, rejected_P)
    return loss, detached_metrics(**metrics)


def hinge_loss(
    chosen_P: Tensor,
    rejected_P: Tensor,
    ref_chosen_P: Tensor,
    ref_rejected_P: Tensor,
    *,
    beta: float = 0.1,
    num_pairs: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[P] summed log-probs -> the hinge loss max(0, 1 - beta d) (RSO / SLiC)."""
    _check_beta(beta)
    _check_count("num_pairs", num_pairs)
    chosen_ratio_P, rejected_ratio_P = _log_ratios(chosen_P, rejected_P, ref_chosen_P, ref_rejected_P)
    losses_P = torch.relu(1.0 - beta * (chosen_ratio_P - rejected_ratio_P))
    loss = _mean(losses_P, num_pairs)
    metrics = _reward_metrics(beta * chosen_ratio_P, beta * rejected_ratio_P, chosen_P, rejected_P)
    return loss, detached_metrics(**metrics)


def ipo_loss(
    chosen_P: Tensor,
    rejected_P: Tensor,
    ref_chosen_P: Tensor,
    ref_rejected_P: Tensor,
    chosen_tokens_P: Tensor,
    rejected_tokens_P: Tensor,
    *,
    beta: float = 0.1,
    num_pairs: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[P] summed log-probs and token counts -> IPO's (d' - 1 / (2 beta))^2, on per-token mean log-ratios
    (as TRL computes it, length-normalised so beta means the same at any completion length)."""
    _check_beta(beta)
    _check_count("num_pairs", num_pairs)
    _check_pairs(chosen_tokens_P=chosen_tokens_P, rejected_tokens_P=rejected_tokens_P, chosen_P=chosen_P)
    chosen_ratio_P, rejected_ratio_P = _log_ratios(chosen_P, rejected_P, ref_chosen_P, ref_rejected_P)
    # at least one token: an empty completion has log-ratio 0, not 0 / 0
    margin_P = chosen_ratio_P / chosen_tokens_P.clamp(min=1.0) - rejected_ratio_P / rejected_tokens_P.clamp(min=1.0)
    losses_P = (margin_P - 1.0 / (2.0 * beta)) ** 2
    loss = _mean(losses_P, num_pairs)
    metrics = _reward_metrics(beta * chosen_ratio_P, beta * rejected_ratio_P, chosen_P, rejected_P)
    return loss, detached_metrics(**metrics)


def _averages(
    chosen_P: Tensor, rejected_P: Tensor, chosen_tokens_P: Tensor, rejected_tokens_P: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-token mean log-probs of chosen and rejected (a count below 1 read as 1)."""
    _check_pairs(
        chosen_P=chosen_P, rejected_P=rejected_P, chosen_tokens_P=chosen_tokens_P, rejected_tokens_P=rejected_tokens_P
    )
    return chosen_P / chosen_tokens_P.clamp(min=1.0), rejected_P / rejected_tokens_P.clamp(min=1.0)


def simpo_loss(
    chosen_P: Tensor,
    rejected_P: Tensor,
    chosen_tokens_P: Tensor,
    rejected_tokens_P: Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    num_pairs: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[P] summed log-probs and token counts -> SimPO: the sigmoid loss on beta (mean pi_c - mean pi_r) - gamma.

    No reference model. Defaults are the SimPO paper's (beta 2, gamma 0.5); gamma is the margin
    itself, as the paper writes it (TRL's CPOConfig.simpo_gamma is the same gamma).
    """
    _check_beta(beta)
    _check_smoothing(label_smoothing)
    _check_count("num_pairs", num_pairs)
    if not 0.0 <= gamma < float("inf"):
        raise ValueError(f"gamma must be a finite number >= 0 (the target reward margin), got {gamma!r}")
    avg_chosen_P, avg_rejected_P = _averages(chosen_P, rejected_P, chosen_tokens_P, rejected_tokens_P)
    losses_P = _smoothed_sigmoid(beta * (avg_chosen_P - avg_rejected_P) - gamma, label_smoothing)
    loss = _mean(losses_P, num_pairs)
    metrics = _reward_metrics(beta * avg_chosen_P, beta * avg_rejected_P, avg_chosen_P, avg_rejected_P)
    return loss, detached_metrics(**metrics)


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - e^x) for x < 0, stable on both sides of log(1/2)."""
    return torch.where(x < _LOG_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen_P: Tensor,
    rejected_P: Tensor,
    chosen_tokens_P: Tensor,
    rejected_tokens_P: Tensor,
    *,
    beta: float = 0.1,
    num_pairs: int | None = None,
    num_chosen_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[P] summed log-probs and token counts -> ORPO: NLL of the chosen tokens - beta mean log s(log odds ratio).

    No reference model. `num_chosen_tokens`: the step's count of chosen tokens, the NLL's denominator
    (None: this batch's own). beta is the paper's lambda.
    """
    _check_beta(beta)
    _check_count("num_pairs", num_pairs)
    _check_count("num_chosen_tokens", num_chosen_tokens)
    avg_chosen_P, avg_rejected_P = _averages(chosen_P, rejected_P, chosen_tokens_P, rejected_tokens_P)
    clamped_chosen_P = avg_chosen_P.clamp(max=ORPO_MAX_AVG_LOGP)
    clamped_rejected_P = avg_rejected_P.clamp(max=ORPO_MAX_AVG_LOGP)
    log_odds_P = (clamped_chosen_P - clamped_rejected_P) - (_log1mexp(clamped_chosen_P) - _log1mexp(clamped_rejected_P))
    ratio_P = F.logsigmoid(log_odds_P)
    tokens = chosen_tokens_P.sum() if num_chosen_tokens is None else num_chosen_tokens
    nll = safe_divide(-chosen_P.sum(), tokens)
    loss = nll - beta * _mean(ratio_P, num_pairs)
    metrics = _reward_metrics(beta * avg_chosen_P, beta * avg_rejected_P, avg_chosen_P, avg_rejected_P)
    return loss, detached_metrics(
        **metrics,
        nll_loss=nll.detach(),
        log_odds_ratio=safe_divide(ratio_P.detach().sum(), ratio_P.numel()),
        log_odds_chosen=safe_divide(log_odds_P.detach().sum(), log_odds_P.numel()),
    )


def kto_loss(
    chosen_P: Tensor,
    rejected_P: Tensor,
    ref_chosen_P: Tensor,
    ref_rejected_P: Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl: Tensor | float | None = None,
    num_pairs: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[P] summed log-probs -> KTO on pairs: each chosen is a desirable example, each rejected an
    undesirable one, the loss their weighted mean. `kl`: the reference point (never differentiated,
    clamped at 0); None: estimated from this batch's log-ratios (see the module docstring)."""
    _check_beta(beta)
    _check_count("num_pairs", num_pairs)
    for name, w in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not 0.0 < w < float("inf"):
            raise ValueError(f"{name} must be a finite number > 0, got {w!r}")
    chosen_ratio_P, rejected_ratio_P = _log_ratios(chosen_P, rejected_P, ref_chosen_P, ref_rejected_P)
    if kl is None:
        both = torch.cat([chosen_ratio_P, rejected_ratio_P]).detach()
        kl_value = safe_divide(both.sum(), both.numel()).clamp(min=0.0)
    else:
        # a float is filled in on the device: a copy from the host would wait for the stream
        kl_tensor = kl if isinstance(kl, Tensor) else torch.full((), kl, dtype=chosen_P.dtype, device=chosen_P.device)
        kl_value = kl_tensor.to(dtype=chosen_P.dtype, device=chosen_P.device).detach().clamp(min=0.0)
    chosen_losses_P = desirable_weight * (1.0 - torch.sigmoid(beta * (chosen_ratio_P - kl_value)))
    rejected_losses_P = undesirable_weight * (1.0 - torch.sigmoid(beta * (kl_value - rejected_ratio_P)))
    losses_N = torch.cat([chosen_losses_P, rejected_losses_P])
    loss = _mean(losses_N, None if num_pairs is None else 2 * num_pairs)
    metrics = _reward_metrics(beta * chosen_ratio_P, beta * rejected_ratio_P, chosen_P, rejected_P)
    return loss, detached_metrics(**metrics, kl=kl_value)


def preference_loss(
    logps: PairLogps,
    config: PreferenceConfig,
    *,
    num_pairs: int | None = None,
    num_chosen_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss `config` names on `logps`, with its options; the step-wide counts as each loss takes them."""
    if not isinstance(config, PreferenceConfig):
        raise TypeError(f"config must be a rollouts.types.PreferenceConfig, got {type(config).__name__}")
    pair = (logps.chosen_P, logps.rejected_P)
    tokens = (logps.chosen_tokens_P, logps.rejected_tokens_P)
    beta, smoothing = config.beta, config.label_smoothing
    if config.loss == "simpo":
        return simpo_loss(
            *pair, *tokens, beta=beta, gamma=config.simpo_gamma, label_smoothing=smoothing, num_pairs=num_pairs
        )
    if config.loss == "orpo":
        return orpo_loss(*pair, *tokens, beta=beta, num_pairs=num_pairs, num_chosen_tokens=num_chosen_tokens)
    if logps.ref_chosen_P is None or logps.ref_rejected_P is None:
        raise ValueError(f"loss {config.loss!r} needs reference log-probs (ref_chosen_P, ref_rejected_P); got None")
    refs = (logps.ref_chosen_P, logps.ref_rejected_P)
    if config.loss == "sigmoid":
        return dpo_loss(*pair, *refs, beta=beta, label_smoothing=smoothing, num_pairs=num_pairs)
    if config.loss == "robust":
        return robust_dpo_loss(*pair, *refs, beta=beta, label_smoothing=smoothing, num_pairs=num_pairs)
    if config.loss == "hinge":
        return hinge_loss(*pair, *refs, beta=beta, num_pairs=num_pairs)
    if config.loss == "ipo":
        return ipo_loss(*pair, *refs, *tokens, beta=beta, num_pairs=num_pairs)
    assert config.loss == "kto", config.loss
    return kto_loss(
        *pair,
        *refs,
        beta=beta,
        desirable_weight=config.desirable_weight,
        undesirable_weight=config.undesirable_weight,
        num_pairs=num_pairs,
    )
