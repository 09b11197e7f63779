"""A step's samples as one rank's micro-batches: the plan, with the step-wide counts the loss needs
(shared by SFT and RL), and the per-token arrays RL adds to it: per-token advantages from rewards
(and per-token KL in the reward), per-sample values scattered into micro-batch rows, and every
rank's per-sample arrays gathered so each rank computes what one process would.

Under torchrun each rank trains samples[rank::world]; the loss is normalised by counts over every
rank, and every rank runs as many forward passes as the busiest one (FSDP's collectives must line up).

Legend: N samples in the step, T tokens of one sample (T_i for sample i), B rows and T_row tokens
of a micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from rollouts.backends import TrainingComponents, document_masked, packed_only
from rollouts.data import plan_micro_batches
from rollouts.data.rollout import EPISODE_KEY
from rollouts.loops.rollouts.functions import GREEDY_REWARD_KEY
from rollouts.loops.run.distributed import all_gather_arrays, global_counts, rank_world, same_count_on_every_rank
from rollouts.losses import gae_advantages, reinforce_pp_advantages, sample_advantages
from rollouts.types import AlgorithmConfig, MicroBatch, Sample

_PADDED_MIN_FILL = 0.9
"""Use the padded layout when padding would waste under 10% of the tokens: packing many short
sequences into one row costs attention over the whole row (block-diagonal mask), padding does not."""


def attention_pair_cost(config: object) -> float | None:
    """The multiply-adds of one query-key pair of attention over those of one token through a layer's
    projections and MLP, from a Llama-style config; None when the config lacks a size.

    Per pair: q.k and p.v over every query head (2 * heads * head_dim). Per token: the q, k, v and o
    projections and a gated MLP (3 * hidden * intermediate). The output layer is left out: it runs
    on the loss tokens only, the same number in either layout.
    """
    sizes = [getattr(config, name, None) for name in ("hidden_size", "intermediate_size", "num_attention_heads")]
    ints = [n for n in sizes if isinstance(n, int) and n > 0]
    if len(ints) != len(sizes):
        return None
    hidden, intermediate, num_heads = ints
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or hidden // num_heads
    if not isinstance(num_kv_heads, int) or not isinstance(head_dim, int) or head_dim < 1:
        return None
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    per_token = hidden * (2 * q_dim + 2 * kv_dim) + 3 * hidden * intermediate
    return 2 * q_dim / per_token


def choose_layout(
    samples: Sequence[Sample],
    *,
    packed_only: bool = False,
    pair_cost: float | None = None,
    max_tokens: int | None = None,
) -> Literal["packed", "padded"]:
    """'padded' for near-uniform lengths, else the cheaper layout by the arithmetic of both.

    `packed_only`: the model's attention takes no padding mask (flash kernels; see
    rollouts.backends.packed_only), so always 'packed'.
    `pair_cost` (`attention_pair_cost` of the model): with it, 'padded' also wins wherever its
    wasted tokens cost less than the attention a packed row spends across its sequences (a packed
    row of `max_tokens` at most attends over the whole row through a dense mask; a padded row of
    length T runs the causal kernel over T * T / 2 pairs). Many short sequences, as in RL
    completions of a small model, pad cheaper than they pack. Without it: 'packed'.
    """
    if packed_only:
        return "packed"
    lengths = [len(s.tokens) for s in samples]
    if not lengths:
        return "padded"
    longest, total = max(lengths), sum(lengths)
    if total >= _PADDED_MIN_FILL * longest * len(lengths):
        return "padded"
    if pair_cost is None:
        return "packed"
    row = total if max_tokens is None else min(total, max_tokens)
    padded = len(lengths) * longest * (1.0 + pair_cost * longest / 2)
    packed = total * (1.0 + pair_cost * row)
    return "padded" if padded <= packed else "packed"


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """This rank's micro-batches for one step and the step-wide loss denominators."""

    local: tuple[Sample, ...]
    """This rank's samples: the step's samples[rank::world]."""
    micro_batches: tuple[MicroBatch[np.ndarray], ...]
    """The planned micro-batches, then zero-loss fillers up to the busiest rank's count."""
    num_real: int
    """How many of `micro_batches` hold this rank's samples (the rest are fillers)."""
    num_tokens: int
    """Loss tokens of the whole step, over every rank."""
    num_sequences: int
    """Sequences of the whole step, over every rank."""


def plan_shard(
    components: TrainingComponents, samples: Sequence[Sample], *, max_tokens_per_micro_batch: int, what: str = "batch"
) -> ShardPlan:
    """Plan this rank's share of `samples` (one process: all of them)."""
    rank, world = rank_world()
    if len(samples) < world:
        raise ValueError(f"{what} of {len(samples)} samples cannot give each of {world} ranks one")
    local = tuple(samples[rank::world])
    model = components.model
    # Packed rows that attend within their sequences only cost no attention across them.
    document = document_masked(model, components.device)
    layout = choose_layout(
        local,
        packed_only=packed_only(model),
        pair_cost=None if document else attention_pair_cost(getattr(model, "config", None)),
        max_tokens=max_tokens_per_micro_batch,
    )
    plan = plan_micro_batches(local, max_tokens=max_tokens_per_micro_batch, layout=layout)
    real = list(plan.micro_batches)
    num_tokens, num_sequences = global_counts(plan.num_loss_tokens, plan.num_sequences)
    return ShardPlan(
        local=local,
        micro_batches=tuple(same_count_on_every_rank(real)),
        num_real=len(real),
        num_tokens=num_tokens,
        num_sequences=num_sequences,
    )


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

    The group estimators see one entry per episode: the pieces of an episode split into several
    Samples (rollouts.data EPISODE_KEY) count once in their group's baseline, with their mean reward
    and summed KL, and each piece gets its episode's advantage. `advantage_fn` replaces the
    configured group estimator (it gets the KL-adjusted rewards and group ids, one per episode).
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
    episode_N, num = episode_indices(samples)
    episode_E = torch.as_tensor(episode_N)
    pieces_E = torch.zeros(num).index_add_(0, episode_E, torch.ones(len(samples)))
    rewards_E = torch.zeros(num).index_add_(0, episode_E, rewards_N) / pieces_E
    if kl is not None:  # KL in the reward, at sequence level (an episode's: all its pieces) for the group estimators
        kl_N = torch.tensor([float((kl[i] * (masks[i] > 0)).sum()) for i in range(len(samples))])
        rewards_E = rewards_E - algorithm.kl_coef * torch.zeros(num).index_add_(0, episode_E, kl_N)
    first_E: list[int] = []  # each episode's first piece (episodes are numbered as they first appear)
    for i, e in enumerate(episode_N):
        if e == len(first_E):
            first_E.append(i)
    groups_E = groups_N[first_E]
    if advantage_fn is not None:
        adv_E = _checked_advantages(advantage_fn(rewards_E, groups_E), num)
    else:  # grpo, rloo, gpg, grpo_passk, remax (gae runs through gae_token_advantages)
        greedy_E = None
        if algorithm.advantage_estimator == "remax":  # the greedy rollout's reward, from the group generator
            missing = [i for i, s in enumerate(samples) if s.metadata.get(GREEDY_REWARD_KEY) is None]
            if missing:
                raise ValueError(
                    f"ReMax advantages need metadata[{GREEDY_REWARD_KEY!r}] (the reward of a greedy response to the "
                    f"prompt) on every sample; samples {missing[:5]} have none: generate with greedy_baseline=True"
                )
            greedy_E = torch.tensor([float(samples[i].metadata[GREEDY_REWARD_KEY]) for i in first_E])
        adv_E = sample_advantages(
            rewards_E,
            groups_E,
            estimator=algorithm.advantage_estimator,
            scale=algorithm.advantage_scale,
            greedy_rewards_B=greedy_E,
        )
    return {i: np.full(n, float(adv_E[episode_N[i]]), dtype=np.float32) for i, n in enumerate(lengths)}


def episode_indices(samples: Sequence[Sample]) -> tuple[list[int], int]:
    """Each sample's episode as 0..E-1 in order of first appearance, and E: samples of one group
    sharing an EPISODE_KEY are pieces of one episode; any other sample is an episode of its own."""
    ids: dict[object, int] = {}
    out = []
    for i, s in enumerate(samples):
        episode = s.metadata.get(EPISODE_KEY)
        key = ("sample", i) if episode is None else ("episode", s.group_index, episode)
        out.append(ids.setdefault(key, len(ids)))
    return out, len(ids)


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
