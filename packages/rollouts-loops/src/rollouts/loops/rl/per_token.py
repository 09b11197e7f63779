"""The per-token glue between a step's samples and its micro-batches: per-token advantages from
rewards (and per-token KL in the reward), scattering per-sample values into micro-batch rows, and
gathering every rank's per-sample arrays so each rank computes what one process would.

Legend: N samples in the step, T tokens of one sample (T_i for sample i), B rows and T_row tokens
of a micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from rollouts.loops.rollouts.functions import GREEDY_REWARD_KEY
from rollouts.loops.run.distributed import all_gather_arrays, rank_world
from rollouts.losses import gae_advantages, reinforce_pp_advantages, sample_advantages
from rollouts.types import AlgorithmConfig, MicroBatch, Sample

__all__ = [
    "AdvantageFn",
    "gae_token_advantages",
    "gather_per_sample",
    "scatter_token_values",
    "token_advantages",
    "whole_batch",
    "with_arrays",
]

AdvantageFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(rewards_N, group ids_N) -> advantages_N, one scalar per sample: the signature of
rollouts.losses.group_advantages and rloo_advantages. Broadcast to the sample's loss tokens."""


def _padded(values: Mapping[int, np.ndarray], num: int) -> torch.Tensor:
    """[N, T_max] float32 tensor of per-sample token arrays (0-padded on the right)."""
    width = max(len(v) for v in values.values())
    out = torch.zeros(num, width)
    for i, v in values.items():
        out[i, : len(v)] = torch.as_tensor(v, dtype=torch.float32)
    return out


def token_advantages(
    samples: Sequence[Sample],
    algorithm: AlgorithmConfig,
    *,
    masks: Mapping[int, np.ndarray],
    kl: Mapping[int, np.ndarray] | None = None,
    advantage_fn: AdvantageFn | None = None,
) -> dict[int, np.ndarray]:
    """Sample index -> [T_i] per-token advantages, from rewards (and per-token KL in the reward).

    `advantage_fn` replaces the configured group estimator (it gets the KL-adjusted rewards).
    """
    rewards_N = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups_N = torch.tensor([s.group_index if s.group_index is not None else i for i, s in enumerate(samples)])
    lengths = [len(masks[i]) for i in range(len(samples))]
    if advantage_fn is None and algorithm.advantage_estimator == "reinforce_pp":
        mask_N_T = _padded(masks, len(samples))
        kl_N_T = _padded(kl, len(samples)) if kl is not None else None
        adv_N_T = reinforce_pp_advantages(
            rewards_N, mask_N_T, kl_B_T=kl_N_T, kl_coef=algorithm.kl_coef, gamma=algorithm.gamma
        )
        return {i: adv_N_T[i, :n].numpy() for i, n in enumerate(lengths)}
    if kl is not None:  # KL in the reward, at sequence level for the group estimators
        rewards_N = rewards_N - algorithm.kl_coef * torch.tensor(
            [float((kl[i] * (masks[i] > 0)).sum()) for i in range(len(samples))]
        )
    if advantage_fn is not None:
        adv_N = _checked_advantages(advantage_fn(rewards_N, groups_N), len(samples))
    else:  # grpo, rloo, gpg, grpo_passk, remax (gae runs through gae_token_advantages)
        greedy_N = None
        if algorithm.advantage_estimator == "remax":  # the greedy rollout's reward, from the group generator
            missing = [i for i, s in enumerate(samples) if s.metadata.get(GREEDY_REWARD_KEY) is None]
            if missing:
                raise ValueError(
                    f"ReMax advantages need metadata[{GREEDY_REWARD_KEY!r}] (the reward of a greedy response to the "
                    f"prompt) on every sample; samples {missing[:5]} have none: generate with greedy_baseline=True"
                )
            greedy_N = torch.tensor([float(s.metadata[GREEDY_REWARD_KEY]) for s in samples], dtype=torch.float32)
        adv_N = sample_advantages(
            rewards_N,
            groups_N,
            estimator=algorithm.advantage_estimator,
            scale=algorithm.advantage_scale,
            greedy_rewards_B=greedy_N,
        )
    return {i: np.full(n, float(adv_N[i]), dtype=np.float32) for i, n in enumerate(lengths)}


def _checked_advantages(adv: object, num: int) -> torch.Tensor:
    if not isinstance(adv, torch.Tensor) or adv.shape != (num,):
        shape = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
        raise ValueError(f"the advantage function must return a [{num}] tensor (one per sample), got {shape}")
    if not bool(torch.isfinite(adv).all()):
        raise ValueError(f"the advantage function returned non-finite advantages: {adv.tolist()[:8]}")
    return adv


def scatter_token_values(
    micro_batches: Sequence[MicroBatch[np.ndarray]], key: str, values: Mapping[int, np.ndarray]
) -> list[MicroBatch[np.ndarray]]:
    """New micro-batches with `key` [B, T_row] holding each sample's [T_i] values where its tokens sit
    (a MicroBatch field, or an extra of that name)."""
    out = []
    for mb in micro_batches:
        array = np.zeros(mb.input_ids.shape, dtype=np.float32)
        for s, index in enumerate(mb.sample_indices):
            array[mb.segment_ids == s] = values[int(index)]
        out.append(mb.replace(**{key: array}))
    return out


def with_arrays(
    micro_batches: Sequence[MicroBatch[np.ndarray]], key: str, arrays: Sequence[np.ndarray]
) -> list[MicroBatch[np.ndarray]]:
    return [mb.replace(**{key: a}) for mb, a in zip(micro_batches, arrays, strict=True)]


def whole_batch(
    masks: dict[int, np.ndarray], kl: dict[int, np.ndarray] | None, *, num_local: int
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray] | None]:
    """Per-sample loss masks (and KL) of the whole batch keyed by global index (gather_per_sample)."""
    gathered = gather_per_sample([masks] if kl is None else [masks, kl], num_local=num_local)
    return gathered[0], (gathered[1] if kl is not None else None)


def gather_per_sample(parts: Sequence[Mapping[int, np.ndarray]], *, num_local: int) -> list[dict[int, np.ndarray]]:
    """Each of `parts` (this rank's per-sample arrays by local index) for the whole batch, keyed by
    global index (rank r holds global samples r, r + world, ...). The same arrays in one process."""
    world = rank_world()[1]
    if world == 1:
        return [dict(p) for p in parts]
    arrays = [p[i] for p in parts for i in range(num_local)]
    out: list[dict[int, np.ndarray]] = [{} for _ in parts]
    for r, theirs in enumerate(all_gather_arrays(arrays)):
        count = len(theirs) // len(parts)
        for k in range(len(parts)):
            for i in range(count):
                out[k][r + i * world] = theirs[k * count + i]
    return out


def gae_token_advantages(
    samples: Sequence[Sample],
    algorithm: AlgorithmConfig,
    *,
    masks: Mapping[int, np.ndarray],
    values: Mapping[int, np.ndarray],
    kl: Mapping[int, np.ndarray] | None = None,
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """(advantages, returns): sample index -> [T_i] per token, by GAE over the trained tokens (tool
    output and prompts are skipped, not steps), the reward at each sample's last trained token and,
    with KL in the reward, -kl_coef * KL on every trained token; advantages whitened over the batch."""
    n = len(samples)
    mask_N_T, values_N_T = _padded(masks, n), _padded(values, n)
    rewards_N_T = torch.zeros_like(mask_N_T)
    for i, s in enumerate(samples):
        trained = np.flatnonzero(masks[i] > 0)
        if trained.size:
            rewards_N_T[i, int(trained[-1])] = float(s.reward or 0.0)
    if kl is not None:
        rewards_N_T = rewards_N_T - algorithm.kl_coef * _padded(kl, n) * (mask_N_T > 0)
    adv_N_T, returns_N_T = gae_advantages(
        rewards_N_T, values_N_T, mask_N_T, gamma=algorithm.gamma, lam=algorithm.lam, whiten=True
    )
    lengths = [len(masks[i]) for i in range(n)]
    return (
        {i: adv_N_T[i, :t].numpy() for i, t in enumerate(lengths)},
        {i: returns_N_T[i, :t].numpy() for i, t in enumerate(lengths)},
    )
