"""Advantage estimators: GRPO (and Dr.GRPO), RLOO, REINFORCE++, GAE, GPG, ReMax, pass@k GRPO, and their token broadcast.

Legend: B samples (one sequence each, padded rows), T tokens. Per-sample inputs are [B];
per-token ones [B, T], token-aligned, with the loss mask selecting the trained tokens.

Conventions follow verl: a GRPO group of one sample has mean 0 and std 1 (its advantage is its
reward), an RLOO or REINFORCE++-baseline group of one keeps its reward, and stds are unbiased. Departures: REINFORCE++
returns and GAE skip tokens outside the mask (tool or user turns inside a response) instead of
resetting at them, so one sample's reward reaches all its trained tokens.

The 2025 estimators, each checked against verl `verl/trainer/ppo/core_algos.py` (read 2026-01-29):
- GPG (Chu et al. 2025, arXiv 2504.02546): alpha (r - group mean), alpha = B / (B - M) rescaling
  for the M samples that carry no gradient. Departure from verl, with the paper: M counts samples
  whose centered reward is 0 (uniform groups); verl divides by the number of non-zero rewards.
  F_norm is 1 (the paper's default; no std division).
- ReMax (Li et al. 2023, arXiv 2310.10505): r - r(greedy response to the same prompt); the loop
  generates the greedy response, this function only subtracts.
- pass@k GRPO (verl "grpo_passk", after arXiv 2503.19595): only each group's best sample gets an
  advantage, r_max - r_second_max (divided by the group std + eps with scale "group"); on ties the
  first best sample (lowest index) is the one, so the advantage is 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollouts.losses.aggregate import check_same_shape
from rollouts.types.configs import AdvantageEstimator, AdvantageScale

__all__ = [
    "broadcast_to_tokens",
    "gae_advantages",
    "gpg_advantages",
    "group_advantages",
    "masked_whiten",
    "passk_advantages",
    "reinforce_pp_advantages",
    "remax_advantages",
    "rloo_advantages",
    "sample_advantages",
]

DEFAULT_EPS = 1e-6
"""Added to a standard deviation before dividing: a group whose rewards all agree gets advantage 0, not NaN."""


def _check_rewards(rewards_B: Tensor, group_ids_B: Tensor | None = None) -> None:
    """Raise unless rewards are a finite floating [B] tensor (and group ids, if given, match it)."""
    for name, value in (("rewards", rewards_B), ("group_ids", group_ids_B)):
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(
                f"{name} must be a [B] torch.Tensor (e.g. torch.tensor([1.0, 0.0])), got {type(value).__name__} "
                f"{_preview(value)}: convert with torch.tensor(...)"
            )
    if not rewards_B.is_floating_point():
        raise TypeError(f"rewards must be a floating-point tensor, got {rewards_B.dtype}: convert with .float()")
    if rewards_B.dim() != 1 or (group_ids_B is not None and group_ids_B.shape != rewards_B.shape):
        ids = None if group_ids_B is None else tuple(group_ids_B.shape)
        raise ValueError(f"rewards and group_ids must be [B] with one shape, got {tuple(rewards_B.shape)} and {ids}")
    if not torch.isfinite(rewards_B).all():
        raise ValueError(f"rewards must be finite, got {rewards_B.tolist()}")


def _preview(value: object, *, max_chars: int = 80) -> str:
    """repr(value), cut to max_chars so an error about a long list stays one line."""
    text = repr(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _check_eps(eps: float) -> None:
    """eps keeps a zero std from dividing by zero: it must be a finite number > 0."""
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(
            f"eps must be a finite number > 0 (a group whose rewards agree would divide by 0), got {eps!r}"
        )


def _group_stats(rewards_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[B] rewards, [B] group ids -> [B] group size, group sum and group unbiased std of each sample's group."""
    _, inverse_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = int(inverse_B.max()) + 1 if inverse_B.numel() else 0
    zeros_G = torch.zeros(num_groups, dtype=rewards_B.dtype, device=rewards_B.device)
    count_G = zeros_G.index_add(0, inverse_B, torch.ones_like(rewards_B))
    sum_G = zeros_G.index_add(0, inverse_B, rewards_B)
    centered_B = rewards_B - (sum_G / count_G)[inverse_B]
    sq_G = zeros_G.index_add(0, inverse_B, centered_B.square())
    std_G = torch.sqrt(sq_G / (count_G - 1).clamp(min=1))
    return count_G[inverse_B], sum_G[inverse_B], std_G[inverse_B]


def group_advantages(
    rewards_B: Tensor, group_ids_B: Tensor, *, scale: AdvantageScale = "group", eps: float = DEFAULT_EPS
) -> Tensor:
    """[B] rewards, [B] group ids -> [B] GRPO advantages (r - group mean) / (std + eps).

    scale "group": the group's std; "batch": the std of all rewards in the batch; "none": no
    division (Dr.GRPO). A group of one has mean 0 and std 1.
    """
    _check_rewards(rewards_B, group_ids_B)
    _check_eps(eps)
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    count_B, sum_B, std_B = _group_stats(rewards_B, group_ids_B)
    single_B = count_B == 1
    mean_B = torch.where(single_B, 0.0, sum_B / count_B)
    centered_B = rewards_B - mean_B
    if scale == "none":
        return centered_B
    if scale == "group":
        return centered_B / (torch.where(single_B, 1.0, std_B) + eps)
    batch_std = rewards_B.std() if rewards_B.numel() > 1 else torch.ones((), dtype=rewards_B.dtype)
    return centered_B / (batch_std + eps)


def rloo_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """[B] rewards, [B] group ids -> [B] RLOO advantages r_i - mean of the other rewards in the group."""
    _check_rewards(rewards_B, group_ids_B)
    count_B, sum_B, _ = _group_stats(rewards_B, group_ids_B)
    others_mean_B = (sum_B - rewards_B) / (count_B - 1).clamp(min=1)
    return torch.where(count_B > 1, rewards_B - others_mean_B, rewards_B)


def gpg_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """[B] rewards, [B] group ids -> [B] GPG advantages alpha (r - group mean), alpha = B / (number of samples
    whose centered reward is not 0); a group of one has mean 0, as in GRPO. All-zero: advantages 0."""
    centered_B = group_advantages(rewards_B, group_ids_B, scale="none")
    num_valid = (centered_B != 0).sum().clamp(min=1).to(rewards_B.dtype)  # alpha in the rewards' precision
    return centered_B * (rewards_B.numel() / num_valid)


def remax_advantages(rewards_B: Tensor, greedy_rewards_B: Tensor, *, group_ids_B: Tensor | None = None) -> Tensor:
    """[B] rewards, [B] reward of the greedy response to each sample's prompt -> [B] ReMax advantages r - r_greedy.

    With group_ids_B, every sample of a group must carry the same greedy reward (one greedy rollout per prompt).
    """
    _check_rewards(rewards_B, group_ids_B)
    _check_rewards(greedy_rewards_B)
    if greedy_rewards_B.shape != rewards_B.shape:
        raise ValueError(
            f"greedy_rewards_B must be [B] like rewards, got {tuple(greedy_rewards_B.shape)} and {tuple(rewards_B.shape)}"
        )
    if group_ids_B is not None:
        _, inverse_B = torch.unique(group_ids_B, return_inverse=True)
        first_G = torch.full(
            (int(inverse_B.max()) + 1 if inverse_B.numel() else 0,),
            torch.nan,
            dtype=greedy_rewards_B.dtype,
            device=greedy_rewards_B.device,
        )
        first_G = first_G.scatter(0, inverse_B.flip(0), greedy_rewards_B.flip(0))  # the first sample's value wins
        if not bool((first_G[inverse_B] == greedy_rewards_B).all()):
            raise ValueError(
                f"greedy_rewards_B must be one value per group (the greedy response to that prompt), got "
                f"{greedy_rewards_B.tolist()[:16]} for groups {group_ids_B.tolist()[:16]}"
            )
    return rewards_B - greedy_rewards_B


def passk_advantages(
    rewards_B: Tensor, group_ids_B: Tensor, *, scale: AdvantageScale = "group", eps: float = DEFAULT_EPS
) -> Tensor:
    """[B] rewards, [B] group ids -> [B] pass@k advantages: r_max - r_second_max on each group's best sample
    (the first one on ties), 0 on every other; divided by the group's unbiased std + eps with scale "group"."""
    _check_rewards(rewards_B, group_ids_B)
    _check_eps(eps)
    if scale not in ("group", "none"):
        raise ValueError(f"scale must be 'group' or 'none' for pass@k advantages, got {scale!r}")
    count_B, _, std_B = _group_stats(rewards_B, group_ids_B)
    if bool((count_B < 2).any()):
        raise ValueError(f"pass@k advantages need >= 2 samples per group, got group sizes {count_B.tolist()[:16]}")
    advantages_B = torch.zeros_like(rewards_B)
    for group in torch.unique(group_ids_B):
        index_K = torch.nonzero(group_ids_B == group).squeeze(-1)
        top2 = torch.topk(rewards_B[index_K], 2, sorted=True).values
        best = index_K[(rewards_B[index_K] == top2[0]).nonzero()[0, 0]]  # the first best sample, whatever topk picks
        gap = top2[0] - top2[1]
        advantages_B[best] = gap / (std_B[best] + eps) if scale == "group" else gap
    return advantages_B


def sample_advantages(
    rewards_B: Tensor,
    group_ids_B: Tensor,
    *,
    estimator: AdvantageEstimator,
    scale: AdvantageScale = "group",
    greedy_rewards_B: Tensor | None = None,
) -> Tensor:
    """[B] rewards, [B] group ids -> [B] one advantage per sample by the named estimator (the group ones:
    grpo, rloo, gpg, grpo_passk, and remax with greedy_rewards_B). reinforce_pp and gae are per token: refused."""
    if estimator == "grpo":
        return group_advantages(rewards_B, group_ids_B, scale=scale)
    if estimator == "rloo":
        return rloo_advantages(rewards_B, group_ids_B)
    if estimator == "gpg":
        return gpg_advantages(rewards_B, group_ids_B)
    if estimator == "grpo_passk":
        return passk_advantages(rewards_B, group_ids_B, scale="none" if scale == "none" else "group")
    if estimator == "remax":
        if greedy_rewards_B is None:
            raise ValueError("estimator 'remax' needs greedy_rewards_B: the reward of a greedy response to each prompt")
        return remax_advantages(rewards_B, greedy_rewards_B, group_ids_B=group_ids_B)
    raise ValueError(
        f"estimator {estimator!r} is not a per-sample estimator; use one of 'grpo', 'rloo', 'gpg', 'grpo_passk', "
        "'remax' (reinforce_pp_advantages and gae_advantages give per-token advantages)"
    )


def masked_whiten(x_B_T: Tensor, mask_B_T: Tensor, *, eps: float = DEFAULT_EPS) -> Tensor:
    """[B, T] -> (x - mean) / (std + eps) over tokens with mask > 0 (unbiased std), 0 elsewhere."""
    check_same_shape(x_B_T=x_B_T, mask_B_T=mask_B_T)
    _check_eps(eps)
    selected = mask_B_T > 0
    n = selected.sum()
    if n == 0:
        return torch.zeros_like(x_B_T)
    mean = torch.where(selected, x_B_T, 0.0).sum() / n
    var = torch.where(selected, (x_B_T - mean).square(), 0.0).sum() / (n - 1).clamp(min=1)
    return torch.where(selected, (x_B_T - mean) / (var.sqrt() + eps), 0.0)


def _discounted_returns(rewards_B_T: Tensor, mask_B_T: Tensor, gamma: float) -> Tensor:
    """[B, T] per-token rewards -> [B, T] sum of gamma^k r over later masked tokens; 0 off the mask."""
    selected = mask_B_T > 0
    returns_B_T = torch.zeros_like(rewards_B_T)
    running_B = torch.zeros_like(rewards_B_T[:, 0])
    for t in reversed(range(rewards_B_T.shape[1])):
        candidate_B = rewards_B_T[:, t] + gamma * running_B
        running_B = torch.where(selected[:, t], candidate_B, running_B)
        returns_B_T[:, t] = torch.where(selected[:, t], candidate_B, 0.0)
    return returns_B_T


def _check_discount(gamma: float, lam: float = 1.0) -> None:
    """Raise unless gamma and lam are in [0, 1]."""
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma ({gamma!r}) and lam ({lam!r}) must be in [0, 1]")


def reinforce_pp_advantages(
    rewards_B: Tensor,
    mask_B_T: Tensor,
    *,
    group_ids_B: Tensor | None = None,
    kl_B_T: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """[B] rewards, [B, T] mask -> [B, T] REINFORCE++ advantages: discounted returns, whitened over the batch.

    The reward sits on each sample's last trained token; kl_coef * kl_B_T is subtracted on every
    trained token (KL in the reward). With group_ids_B the group mean is subtracted first
    (REINFORCE++-baseline); a group of one keeps its reward (mean 0, as in `group_advantages`).
    """
    _check_rewards(rewards_B, group_ids_B)
    if mask_B_T.dim() != 2 or mask_B_T.shape[0] != rewards_B.shape[0]:
        raise ValueError(
            f"rewards must be [B] and mask [B, T], got {tuple(rewards_B.shape)} and {tuple(mask_B_T.shape)}"
        )
    _check_discount(gamma)
    _check_eps(eps)
    if group_ids_B is not None:
        count_B, sum_B, _ = _group_stats(rewards_B, group_ids_B)
        # a group of one has mean 0 (as in GRPO and verl): its own reward is no baseline for itself
        rewards_B = rewards_B - torch.where(count_B == 1, 0.0, sum_B / count_B)
    selected = mask_B_T > 0
    positions_T = torch.arange(mask_B_T.shape[1], device=mask_B_T.device)
    last_B = torch.where(selected, positions_T, -1).amax(dim=1)
    token_rewards_B_T = torch.where(positions_T == last_B[:, None], rewards_B[:, None], 0.0).to(rewards_B.dtype)
    if kl_B_T is not None:
        check_same_shape(kl_B_T=kl_B_T, mask_B_T=mask_B_T)
        token_rewards_B_T = token_rewards_B_T - kl_coef * torch.where(selected, kl_B_T.detach(), 0.0)
    return masked_whiten(_discounted_returns(token_rewards_B_T, mask_B_T, gamma), mask_B_T, eps=eps)


def gae_advantages(
    rewards_B_T: Tensor,
    values_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = True,
    eps: float = DEFAULT_EPS,
) -> tuple[Tensor, Tensor]:
    """[B, T] token rewards, values, mask -> ([B, T] GAE advantages, [B, T] returns = advantages + values).

    delta_t = r_t + gamma V_next - V_t; A_t = delta_t + gamma lam A_next, over trained tokens
    only (0 elsewhere). Returns are computed before whitening; whiten normalizes the advantages.
    """
    check_same_shape(rewards_B_T=rewards_B_T, values_B_T=values_B_T, mask_B_T=mask_B_T)
    _check_discount(gamma, lam)
    if whiten:
        _check_eps(eps)
    selected = mask_B_T > 0
    rewards_B_T, values_B_T = rewards_B_T.detach(), values_B_T.detach()
    advantages_B_T = torch.zeros_like(rewards_B_T)
    next_value_B = torch.zeros_like(rewards_B_T[:, 0])
    next_adv_B = torch.zeros_like(next_value_B)
    for t in reversed(range(rewards_B_T.shape[1])):
        delta_B = rewards_B_T[:, t] + gamma * next_value_B - values_B_T[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        advantages_B_T[:, t] = torch.where(selected[:, t], adv_B, 0.0)
        next_value_B = torch.where(selected[:, t], values_B_T[:, t], next_value_B)
        next_adv_B = torch.where(selected[:, t], adv_B, next_adv_B)
    returns_B_T = torch.where(selected, advantages_B_T + values_B_T, 0.0)
    if whiten:
        advantages_B_T = masked_whiten(advantages_B_T, mask_B_T, eps=eps)
    return advantages_B_T, returns_B_T


def broadcast_to_tokens(advantages_B: Tensor, mask_B_T: Tensor) -> Tensor:
    """[B] per-sample advantages, [B, T] mask -> [B, T] the sample's advantage on its trained tokens, 0 elsewhere."""
    if advantages_B.dim() != 1 or mask_B_T.dim() != 2 or mask_B_T.shape[0] != advantages_B.shape[0]:
        raise ValueError(
            f"advantages must be [B] and mask [B, T], got {tuple(advantages_B.shape)} and {tuple(mask_B_T.shape)}"
        )
    return torch.where(mask_B_T > 0, advantages_B[:, None], 0.0).to(advantages_B.dtype)
