"""A critic for PPO: a value head on a causal LM's backbone, its values per token, and its update.

Legend: B rows, T tokens per row, H hidden size.

Values are token-aligned like log-probs: entry t is V of the state before token t was generated,
read from the hidden state at t - 1 (0 at sequence starts and on padding), so a response token's
value sits beside its log-prob and advantage. The critic is a TrainingComponents like the policy
(AdamW, schedule), checkpointed with the same `save_checkpoint` / `load_checkpoint`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollouts.backends.train.components import (
    TrainingComponents,
    build_optimizer,
    build_scheduler,
    load_hf_model,
    model_attr,
)
from rollouts.backends.train.distributed import data_parallel_size, shard_model, step_collectives
from rollouts.backends.train.inputs import micro_batch_to_torch, model_inputs
from rollouts.losses import Reduction, floats_of, value_loss
from rollouts.types import MicroBatch, OptimizerConfig

__all__ = ["ValueModel", "build_critic", "compute_values", "critic_forward_backward"]


class ValueModel(torch.nn.Module):
    """A causal LM's backbone (its output projection dropped) and a linear value head, zero-initialised
    (every value starts at 0, as the returns' baseline)."""

    def __init__(self, causal_lm: torch.nn.Module) -> None:
        super().__init__()
        prefix = getattr(causal_lm, "base_model_prefix", "model")
        backbone = getattr(causal_lm, prefix, None)
        if backbone is None or not hasattr(causal_lm, "config"):
            raise ValueError(f"{type(causal_lm).__name__} has no backbone `{prefix}` to put a value head on")
        self.backbone = backbone
        self.config = model_attr(causal_lm, "config")
        self.head = torch.nn.Linear(self.config.hidden_size, 1, dtype=next(backbone.parameters()).dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self._no_split_modules = getattr(causal_lm, "_no_split_modules", None)  # FSDP2 sharding units

    def forward(self, batch: MicroBatch[torch.Tensor]) -> torch.Tensor:
        """[B, T] values, token-aligned (0 where no token is predicted)."""
        hidden_B_T_H = self.backbone(**model_inputs(self, batch), use_cache=False)[0]
        values_B_T = self.head(hidden_B_T_H[:, :-1]).squeeze(-1).float()
        predicted_B_T = (batch.position_ids[:, 1:] > 0) & (batch.attention_mask[:, 1:] > 0)
        zeros = values_B_T.new_zeros(values_B_T.shape[0], 1)
        return torch.cat([zeros, torch.where(predicted_B_T, values_B_T, 0.0)], dim=1)


def build_critic(
    model_path: str | Path | torch.nn.Module,
    config: OptimizerConfig,
    *,
    num_training_steps: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    shard: bool = False,
    gather_once_per_step: bool = False,
) -> TrainingComponents:
    """A critic from a causal LM (a local path or a module: its backbone is copied into the value
    model, so the policy's own weights are never shared), with its own AdamW and schedule.
    `shard`: under torchrun, shard it with FSDP2 like the policy (before the optimizer is built);
    `gather_once_per_step` as in `shard_model`."""
    if isinstance(model_path, torch.nn.Module):
        causal_lm = copy.deepcopy(model_path)
    else:
        causal_lm = load_hf_model(model_path, dtype=dtype, device=device, attn_implementation=attn_implementation)
    model: torch.nn.Module = ValueModel(causal_lm).to(torch.device(device))
    if shard:
        model = shard_model(model, gather_once_per_step=gather_once_per_step)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, num_training_steps=num_training_steps)
    return TrainingComponents(model=model, optimizer=optimizer, scheduler=scheduler, device=torch.device(device))


@torch.no_grad()
def compute_values(critic: TrainingComponents, micro_batches: Sequence[MicroBatch[np.ndarray]]) -> list[np.ndarray]:
    """[B, T] float32 values per micro-batch, without gradients (the old values of an update)."""
    model = critic.model
    was_training = model.training
    model.eval()
    try:
        return [model(micro_batch_to_torch(mb, critic.device)).cpu().numpy() for mb in micro_batches]
    finally:
        model.train(was_training)


def critic_forward_backward(
    critic: TrainingComponents,
    micro_batches: Sequence[MicroBatch[np.ndarray]],
    *,
    num_tokens: int,
    clip_range: float | None,
) -> dict[str, Any]:
    """Clipped value loss over a step's micro-batches (each with extras "returns" and "old_values",
    [B, T]); gradients accumulate in the critic. `num_tokens`: the step's loss tokens over all ranks."""
    model = critic.model
    model.train()
    num_ranks = data_parallel_size(model)
    # the losses and clip fractions stay on the device until the last backward is queued (one read)
    losses: list[torch.Tensor] = []
    clip_fracs: list[torch.Tensor | float] = []
    token_counts: list[float] = []
    with step_collectives(model, len(micro_batches)) as before_micro_batch:
        for index, micro_batch in enumerate(micro_batches):
            before_micro_batch(index)
            batch = micro_batch_to_torch(micro_batch, critic.device)
            returns, old = batch.extras.get("returns"), batch.extras.get("old_values")
            if returns is None or old is None:
                raise ValueError("critic micro-batches need extras 'returns' and 'old_values' ([B, T] each)")
            values_B_T = model(batch)
            reduction = Reduction(num_tokens=num_tokens)
            loss, metrics = value_loss(
                values_B_T, old, returns, batch.loss_mask, clip_range=clip_range, reduction=reduction
            )
            (loss * num_ranks if num_ranks > 1 else loss).backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
            losses.append(loss.detach())
            clip_fracs.append(metrics.get("vf_clip_frac", 0.0))
            token_counts.append(float(max(int(np.count_nonzero(np.asarray(micro_batch.loss_mask) > 0)), 1)))
    values = floats_of([*losses, *clip_fracs])
    loss_values, clip_values = values[: len(losses)], values[len(losses) :]
    weighted = sum(tokens * frac for tokens, frac in zip(token_counts, clip_values, strict=True))
    return {"vf_loss": sum(loss_values), "vf_clip_frac": weighted / max(sum(token_counts), 1.0)}
