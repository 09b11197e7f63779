"""One RL update on a batch of scored samples: per-token advantages, old and reference log-probs,
then `num_updates_per_batch` optimizer steps. The per-token glue between samples and micro-batches
(advantages, scatter, unpack) lives here, apart from the loop.

Legend: N samples in the step, T tokens of one sample (T_i for sample i), B rows and T_row tokens
of a micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from rollouts.backends import TrainingComponents, compute_logprobs, forward_backward, optim_step
from rollouts.data import unpack_values
from rollouts.loops.distributed import all_gather_arrays, global_sum, rank_world
from rollouts.loops.micro_batches import plan_shard
from rollouts.losses import LossFn, kl_penalty, loss_fn_from_config, reinforce_pp_advantages, sample_advantages
from rollouts.types import AlgorithmConfig, MicroBatch, RLConfig, Sample, TrainingState

AdvantageFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(rewards_N, group ids_N) -> advantages_N, one scalar per sample: the signature of
rollouts.losses.group_advantages and rloo_advantages. Broadcast to the sample's loss tokens."""


def check_algorithm(algorithm: AlgorithmConfig) -> None:
    """Raise for settings the RL loop cannot run (before any work starts)."""
    if algorithm.advantage_estimator == "gae":
        raise ValueError(
            "AlgorithmConfig.advantage_estimator 'gae' needs a learned value model, which the RL loop does not "
            "train; use 'grpo', 'rloo', 'gpg', 'grpo_passk' or 'reinforce_pp' (or call "
            "rollouts.losses.gae_advantages in your own loop)"
        )
    if algorithm.advantage_estimator == "remax":
        raise ValueError(
            "AlgorithmConfig.advantage_estimator 'remax' needs the reward of a greedy response to each prompt, "
            "which the RL loop does not generate; use rollouts.losses.remax_advantages in your own loop, or pass "
            "an advantages function that computes it"
        )


def default_loss_fn(config: RLConfig) -> LossFn:
    """The configured loss; Dr.GRPO's norm constant defaults to the longest possible response.

    (A constant that is the same in every micro-batch and step: each micro-batch's padded length
    would make the gradient depend on how the step was split.)
    With overlap, `config.effective_algorithm` adds the truncated importance weights of
    RLConfig.overlap_is_cap unless the algorithm sets its own is_cap.
    """
    algorithm = config.effective_algorithm
    if algorithm.loss_aggregation == "seq-mean-token-sum-norm" and algorithm.norm_constant is None:
        algorithm = dataclasses.replace(algorithm, norm_constant=float(config.rollout.sampling.max_new_tokens))
    return loss_fn_from_config(algorithm)


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
    else:  # grpo, rloo, gpg, grpo_passk (check_algorithm refused the rest)
        adv_N = sample_advantages(
            rewards_N, groups_N, estimator=algorithm.advantage_estimator, scale=algorithm.advantage_scale
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


def _with_arrays(
    micro_batches: Sequence[MicroBatch[np.ndarray]], key: str, arrays: Sequence[np.ndarray]
) -> list[MicroBatch[np.ndarray]]:
    return [mb.replace(**{key: a}) for mb, a in zip(micro_batches, arrays, strict=True)]


def rl_update(
    components: TrainingComponents,
    state: TrainingState,
    samples: Sequence[Sample],
    config: RLConfig,
    *,
    ref_components: TrainingComponents | None = None,
    advantage_fn: AdvantageFn | None = None,
    loss_fn: LossFn | None = None,
) -> tuple[TrainingState, dict[str, float]]:
    """Advantages, log-probs and `num_updates_per_batch` optimizer steps on one batch of samples.

    Under torchrun every rank calls it with the same samples and trains its share,
    samples[rank::world]. Log-probs (old, reference) are computed for the share on its rank; the
    advantages, which may need the whole batch (group statistics with KL in the reward,
    REINFORCE++'s batch whitening), come from every rank's per-token masks and KL, gathered as
    tensors, so each rank computes exactly what one process would.
    """
    algorithm = config.effective_algorithm
    rank, world = rank_world()
    shard = plan_shard(components, samples, max_tokens_per_micro_batch=config.max_tokens_per_micro_batch)
    real = shard.micro_batches[: shard.num_real]
    mbs = list(shard.micro_batches)
    masks = unpack_values(real, [mb.loss_mask for mb in real])
    metrics: dict[str, float] = {}
    need_old = algorithm.num_updates_per_batch > 1 or algorithm.kl_placement == "reward"
    # The policy trained is the one sampled from: logits / sampling temperature, truncated by top-k
    # and top-p and renormalised, as the engine drew from it (temperature 0, greedy: the plain softmax).
    sampling = config.rollout.sampling
    temperature = sampling.temperature or 1.0
    dist = {"top_k": sampling.top_k, "top_p": sampling.top_p} if sampling.temperature else {}
    old = compute_logprobs(components, mbs, temperature=temperature, **dist) if need_old else None
    if old is not None and algorithm.num_updates_per_batch > 1:
        mbs = _with_arrays(mbs, "old_logprobs", old)
    kl_local = None
    if algorithm.needs_reference:
        if ref_components is None:
            raise ValueError("the algorithm puts a KL term in the loss or reward but no reference model was given")
        ref = compute_logprobs(ref_components, mbs, temperature=temperature, **dist)
        mbs = _with_arrays(mbs, "ref_logprobs", ref)
        if algorithm.kl_placement == "reward":
            assert old is not None
            kl_mbs = [
                kl_penalty(torch.from_numpy(o), torch.from_numpy(r), kind=algorithm.kl_kind).numpy()
                for o, r in zip(old[: shard.num_real], ref[: shard.num_real], strict=True)
            ]
            kl_local = unpack_values(real, kl_mbs)
    all_masks, all_kl = _whole_batch(masks, kl_local, num_local=len(shard.local))
    if all_kl is not None:
        kl_sum = sum(float((all_kl[i] * (all_masks[i] > 0)).sum()) for i in all_masks)
        metrics["kl_reward"] = kl_sum / max(1, shard.num_tokens)
    advantages = token_advantages(samples, algorithm, masks=all_masks, kl=all_kl, advantage_fn=advantage_fn)
    mbs = scatter_token_values(mbs, "advantages", {i: advantages[rank + i * world] for i in range(len(shard.local))})
    loss_fn = loss_fn if loss_fn is not None else default_loss_fn(config)
    for _ in range(algorithm.num_updates_per_batch):
        fb = forward_backward(
            components,
            mbs,
            loss_fn,
            num_tokens=shard.num_tokens,
            num_sequences=shard.num_sequences,
            temperature=temperature,
            **dist,
        )
        fb["loss"] = global_sum(fb["loss"])  # the step's loss over all ranks (itself on one process)
        state, om = optim_step(
            components, state, config.optimizer, num_tokens=shard.num_tokens, num_samples=len(samples), loss=fb["loss"]
        )
        metrics.update(fb)
        metrics.update(om)
    return state, metrics


def _whole_batch(
    masks: dict[int, np.ndarray], kl: dict[int, np.ndarray] | None, *, num_local: int
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray] | None]:
    """Per-sample loss masks (and KL) of the whole batch keyed by global index, from each rank's
    share (rank r holds global samples r, r + world, ...). The same dicts in one process."""
    world = rank_world()[1]
    if world == 1:
        return masks, kl
    arrays = [masks[i] for i in range(num_local)] + ([kl[i] for i in range(num_local)] if kl is not None else [])
    all_masks: dict[int, np.ndarray] = {}
    all_kl: dict[int, np.ndarray] | None = {} if kl is not None else None
    for r, theirs in enumerate(all_gather_arrays(arrays)):
        count = len(theirs) // 2 if kl is not None else len(theirs)
        for i in range(count):
            all_masks[r + i * world] = theirs[i]
            if all_kl is not None:
                all_kl[r + i * world] = theirs[count + i]
    return all_masks, all_kl
