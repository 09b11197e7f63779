"""One RL update on a batch of scored samples: per-token advantages, old and reference log-probs,
then `num_updates_per_batch` optimizer steps. The per-token glue between samples and micro-batches
(advantages, scatter, gathering across ranks) is per_token.py.

Legend: N samples in the step, T tokens of one sample (T_i for sample i), B rows and T_row tokens
of a micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rollouts.backends import TrainingComponents, compute_logprobs, forward_backward, optim_step
from rollouts.backends.train.value import compute_values, critic_forward_backward
from rollouts.data import unpack_values
from rollouts.loops.micro_batches import plan_shard
from rollouts.loops.rl.per_token import (
    AdvantageFn,
    gae_token_advantages,
    gather_per_sample,
    scatter_token_values,
    token_advantages,
    whole_batch,
    with_arrays,
)
from rollouts.loops.run.distributed import global_sum, rank_world
from rollouts.losses import LossFn, kl_penalty, loss_fn_from_config
from rollouts.types import RLConfig, Sample, TrainingState


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


def rl_update(
    components: TrainingComponents,
    state: TrainingState,
    samples: Sequence[Sample],
    config: RLConfig,
    *,
    ref_components: TrainingComponents | None = None,
    advantage_fn: AdvantageFn | None = None,
    loss_fn: LossFn | None = None,
    critic: TrainingComponents | None = None,
) -> tuple[TrainingState, dict[str, float]]:
    """Advantages, log-probs and `num_updates_per_batch` optimizer steps on one batch of samples.

    With GAE (PPO with a critic) the critic's values give the advantages and returns, and after the
    policy's steps the critic takes as many, on the clipped value loss (RLConfig.critic).

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
        mbs = with_arrays(mbs, "old_logprobs", old)
    kl_local = None
    if algorithm.needs_reference:
        if ref_components is None:
            raise ValueError("the algorithm puts a KL term in the loss or reward but no reference model was given")
        ref = compute_logprobs(ref_components, mbs, temperature=temperature, **dist)
        mbs = with_arrays(mbs, "ref_logprobs", ref)
        if algorithm.kl_placement == "reward":
            assert old is not None
            kl_mbs = [
                kl_penalty(torch.from_numpy(o), torch.from_numpy(r), kind=algorithm.kl_kind).numpy()
                for o, r in zip(old[: shard.num_real], ref[: shard.num_real], strict=True)
            ]
            kl_local = unpack_values(real, kl_mbs)
    all_masks, all_kl = whole_batch(masks, kl_local, num_local=len(shard.local))
    if all_kl is not None:
        kl_sum = sum(float((all_kl[i] * (all_masks[i] > 0)).sum()) for i in all_masks)
        metrics["kl_reward"] = kl_sum / max(1, shard.num_tokens)
    mine = range(len(shard.local))
    if algorithm.advantage_estimator == "gae":
        if critic is None:
            raise ValueError("GAE advantages need a critic: pass critic (rollouts.backends.build_critic)")
        old_values = compute_values(critic, mbs)
        values_local = unpack_values(real, old_values[: shard.num_real])
        (all_values,) = gather_per_sample([values_local], num_local=len(shard.local))
        advantages, returns = gae_token_advantages(samples, algorithm, masks=all_masks, values=all_values, kl=all_kl)
        mbs = with_arrays(mbs, "old_values", old_values)
        mbs = scatter_token_values(mbs, "returns", {i: returns[rank + i * world] for i in mine})
        metrics["value_mean"] = sum(float((v * (all_masks[i] > 0)).sum()) for i, v in all_values.items()) / max(
            1, shard.num_tokens
        )
    else:
        advantages = token_advantages(samples, algorithm, masks=all_masks, kl=all_kl, advantage_fn=advantage_fn)
    mbs = scatter_token_values(mbs, "advantages", {i: advantages[rank + i * world] for i in mine})
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
    if critic is not None and algorithm.advantage_estimator == "gae":
        for _ in range(algorithm.num_updates_per_batch):
            vf = critic_forward_backward(critic, mbs, num_tokens=shard.num_tokens, clip_range=config.critic.clip_range)
            vf["vf_loss"] = global_sum(vf["vf_loss"])
            _, critic_metrics = optim_step(critic, TrainingState(), config.critic.optimizer, loss=vf["vf_loss"])
            metrics.update(vf, vf_grad_norm=critic_metrics["grad_norm"])
    return state, metrics
