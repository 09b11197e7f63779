"""KL penalties to a reference policy and importance weights for the rollout-vs-trainer mismatch.

Legend: B rows, T tokens per row, S sequences. Per-token tensors are [B, T] and token-aligned.

KL estimators (Schulman's k1/k2/k3) of KL(pi || pi_ref) from samples of pi:
  k1 = log pi - log pi_ref;  abs = |k1|;  k2 = 0.5 k1^2;
  k3 = low_var_kl = exp(d) - d - 1 with d = log pi_ref - log pi (clamped to [0, 10]; verl's upper clamp).
  k1+, k3+ = straight-through: the value of k1 (k3), the gradient of k2. k1 and k3 are unbiased
  estimates of the KL's value but not of its gradient; k2's gradient, (log pi - log pi_ref) grad log pi,
  is the KL's gradient in expectation (verl `core_algos.py` kl_penalty, "k1+"/"k3+", read 2026-01-29).
Whether the penalty goes into the loss or into the reward is the loop's choice.

The adaptive KL controller (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences", section 2.2; verl `AdaptiveKLController`, same file) is a pure function here:
`adaptive_kl_update(state, observed_kl=..., ...)` returns the next `KLControllerState`, which the
loop keeps (and checkpoints) with the rest of its state:
  coef <- coef * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon).
The horizon counts RL steps by default (n = num_steps); given `num_samples`, it counts samples
(n = num_samples), as verl's trainer and Ziegler et al.'s code do (they pass the batch size). With
the same horizon, counting steps adapts batch-size times more slowly: after 50 steps of 64
sequences at horizon 10000, 0.05 becomes 0.05002 counting steps and 0.05142 counting samples for a
proportional error of 0.0875. Steps are the default so that a horizon means the same thing
whatever the batch size; `horizon / batch size` steps is verl's horizon.
Whether the penalty goes into the loss or into the reward is the loop's choice.

Importance weights correct for the inference engine sampling from a slightly different policy
than the trainer computes (different kernels, precision, or a stale weight version):
w = pi_trainer_old / pi_engine per token, or its product over a sequence, capped at `cap`
(truncated IS) or zeroed above it (masked IS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rollouts.losses.aggregate import check_same_shape, masked_mean, sequence_sums, to_tokens
from rollouts.losses.metrics import detached_metrics
from rollouts.types.configs import ISLevel, ISMode, KLKind

__all__ = ["KL_KINDS", "KLControllerState", "adaptive_kl_update", "importance_weights", "kl_penalty"]

KL_KINDS: tuple[str, ...] = ("k1", "abs", "k2", "k3", "low_var_kl", "k1+", "k3+")
KL_CONTROLLER_MAX_ERROR = 0.2
"""Clip on the controller's proportional error KL / target - 1 (Ziegler et al.): one noisy KL
measurement moves the coefficient by at most 20% x num_steps / horizon."""
MAX_KL_LOG_RATIO = 20.0
"""Clamp on log(pi_ref / pi) before exp() in k3, so an unlikely token cannot overflow the estimate."""
MAX_K3 = 10.0
"""Clamp on the k3 estimate itself (verl's low_var_kl): one outlier token cannot dominate the penalty."""
MAX_IS_LOG_WEIGHT = 20.0
"""Clamp on the log importance weight before exp(): the cap applies after, so nothing overflows first."""


def kl_penalty(logprobs_B_T: Tensor, ref_logprobs_B_T: Tensor, *, kind: KLKind) -> Tensor:
    """[B, T] log-probs under the policy and the reference -> [B, T] per-token KL estimate of the given kind."""
    check_same_shape(logprobs_B_T=logprobs_B_T, ref_logprobs_B_T=ref_logprobs_B_T)
    diff_B_T = logprobs_B_T - ref_logprobs_B_T.detach()
    if kind == "k1":
        return diff_B_T
    if kind == "abs":
        return diff_B_T.abs()
    if kind == "k2":
        return 0.5 * diff_B_T.square()
    if kind in ("k3", "low_var_kl"):
        d_B_T = torch.clamp(-diff_B_T, -MAX_KL_LOG_RATIO, MAX_KL_LOG_RATIO)
        # exp(d) - d - 1 >= 0, but for |d| near float epsilon rounding can give -6e-8: clamp at 0.
        return torch.clamp(torch.exp(d_B_T) - d_B_T - 1.0, 0.0, MAX_K3)
    if kind in ("k1+", "k3+"):
        value_B_T = kl_penalty(logprobs_B_T, ref_logprobs_B_T, kind="k1" if kind == "k1+" else "k3")
        k2_B_T = 0.5 * diff_B_T.square()
        return k2_B_T - k2_B_T.detach() + value_B_T.detach()
    raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class KLControllerState:
    """The adaptive KL controller's state: the coefficient to use for the next step."""

    coef: float
    """Current KL coefficient (AlgorithmConfig.kl_coef at the start of a run)."""


def adaptive_kl_update(
    state: KLControllerState,
    *,
    observed_kl: float,
    target_kl: float,
    horizon: int,
    num_steps: int = 1,
    num_samples: int | None = None,
) -> KLControllerState:
    """The controller's next state after `num_steps` steps whose mean KL was `observed_kl`.

    coef * (1 + clip(observed_kl / target_kl - 1, -0.2, 0.2) * n / horizon): the coefficient grows
    while the KL is above target and shrinks while it is below. n is `num_steps` (the default: the
    horizon counts steps) or, when given, `num_samples`, the samples those steps trained on (the
    horizon counts samples, as verl's, which is batch-size times faster for the same horizon).
    """
    if not (math.isfinite(state.coef) and state.coef > 0):
        raise ValueError(
            f"state.coef must be a finite number > 0 (a multiplicative update keeps 0 at 0), got {state.coef!r}"
        )
    if not (math.isfinite(observed_kl) and observed_kl >= 0):
        raise ValueError(f"observed_kl must be a finite number >= 0 (a KL estimate), got {observed_kl!r}")
    if not (math.isfinite(target_kl) and target_kl > 0):
        raise ValueError(f"target_kl must be a finite number > 0, got {target_kl!r}")
    counts = {"horizon": horizon, "num_steps": num_steps}
    if num_samples is not None:
        counts["num_samples"] = num_samples
    for name, count in counts.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name} must be an int >= 1, got {count!r}")
    name, elapsed = ("num_steps", num_steps) if num_samples is None else ("num_samples", num_samples)
    if elapsed > horizon:
        raise ValueError(
            f"{name} ({elapsed}) must be <= horizon ({horizon}): beyond 5 x horizon one update could make the "
            "coefficient negative"
        )
    error = min(max(observed_kl / target_kl - 1.0, -KL_CONTROLLER_MAX_ERROR), KL_CONTROLLER_MAX_ERROR)
    return KLControllerState(coef=state.coef * (1.0 + error * elapsed / horizon))


def importance_weights(
    old_logprobs_B_T: Tensor,
    rollout_logprobs_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    cap: float,
    level: ISLevel = "token",
    mode: ISMode = "truncate",
    segment_ids_B_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[B, T] trainer and engine log-probs -> ([B, T] detached weights, 0 off the mask; metrics).

    level "token": w_t = exp(old_t - rollout_t); "sequence": the product of a sequence's token
    ratios on every token of it. mode "truncate": min(w, cap); "mask": w where w <= cap, else 0.
    """
    check_same_shape(
        old_logprobs_B_T=old_logprobs_B_T,
        rollout_logprobs_B_T=rollout_logprobs_B_T,
        mask_B_T=mask_B_T,
        segment_ids_B_T=segment_ids_B_T,
    )
    if not (isinstance(cap, (int, float)) and cap >= 1.0):
        raise ValueError(f"cap must be >= 1 (a weight of 1 means no correction), got {cap!r}")
    levels: tuple[Literal["token", "sequence"], ...] = ("token", "sequence")
    if level not in levels:
        raise ValueError(f"level must be one of {levels}, got {level!r}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    selected_B_T = mask_B_T > 0
    log_w_B_T = torch.where(selected_B_T, (old_logprobs_B_T - rollout_logprobs_B_T).detach(), 0.0)
    if level == "sequence":
        log_w_B_T = to_tokens(sequence_sums(log_w_B_T, segment_ids_B_T), segment_ids_B_T, log_w_B_T.shape)
    raw_B_T = torch.exp(torch.clamp(log_w_B_T, -MAX_IS_LOG_WEIGHT, MAX_IS_LOG_WEIGHT))
    over_cap_B_T = raw_B_T > cap
    weights_B_T = torch.clamp(raw_B_T, max=cap) if mode == "truncate" else torch.where(over_cap_B_T, 0.0, raw_B_T)
    weights_B_T = torch.where(selected_B_T, weights_B_T, 0.0)
    return weights_B_T, detached_metrics(
        is_weight_mean=masked_mean(weights_B_T, mask_B_T),
        is_raw_weight_mean=masked_mean(raw_B_T, mask_B_T),
        is_capped_frac=masked_mean(over_cap_B_T.float(), mask_B_T),
    )
