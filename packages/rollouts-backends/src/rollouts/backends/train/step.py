"""Training as functions: forward_backward accumulates gradients, optim_step applies them.

Legend: B sequences (rows), T tokens, H hidden size, V vocabulary, S sequences in a micro-batch.

Micro-batches are `rollouts.types.MicroBatch` of numpy arrays (rollouts-data builds them); how
they are checked, moved and laid out for the model is in rollouts.backends.train.inputs. The
log-probs are computed from the last hidden state at the positions that need one, chunk by
chunk, so the full [B, T, V] logits never exist (rollouts.backends.train.hidden).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rollouts.backends.train.components import TrainingComponents
from rollouts.backends.train.distill_term import DISTILL_DIVERGENCE_METRIC, DistillTerm, distill_term
from rollouts.backends.train.distributed import data_parallel_size, step_collectives
from rollouts.backends.train.hidden import kept_hidden, layout_logprobs, logprobs_at, token_logprobs_of_model
from rollouts.backends.train.inputs import host_layout, micro_batch_to_torch
from rollouts.losses import LossFn, Metrics, floats_of
from rollouts.types import MicroBatch, OptimizerConfig, TrainingState

__all__ = [
    "DISTILL_DIVERGENCE_METRIC",
    "DistillTerm",
    "NonFiniteError",
    "compute_logprobs",
    "forward_backward",
    "optim_step",
    "token_logprobs_of_model",
]

_MAX_NAMED_PARAMETERS = 5
"""How many offending parameter names a non-finite error lists (the rest are counted)."""


class NonFiniteError(FloatingPointError):
    """Raised when too many optimizer steps in a row had a non-finite loss or gradient."""


def forward_backward(
    components: TrainingComponents,
    micro_batches: Sequence[MicroBatch[np.ndarray]],
    loss_fn: LossFn,
    *,
    num_tokens: int,
    num_sequences: int,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    distill: DistillTerm | None = None,
) -> dict[str, float]:
    """Forward and backward over a step's micro-batches; gradients accumulate in the model.

    `num_tokens` / `num_sequences` are the loss-token and sequence counts of the WHOLE step (all
    micro-batches, all ranks), so the summed micro-batch gradients equal one big batch's.
    Metrics: `loss` is the step's loss (sum over micro-batches); the loss function's metrics (floats
    or 0-dim tensors) are averaged over micro-batches weighted by their loss tokens, read from the device
    only after the last backward is queued. With `distill`, its term joins each micro-batch's loss
    and its divergence is the metric DISTILL_DIVERGENCE_METRIC.
    """
    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    if num_tokens < 0 or num_sequences < 0:
        raise ValueError(f"num_tokens ({num_tokens}) and num_sequences ({num_sequences}) must be >= 0")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    model = components.model
    model.train()
    num_ranks = data_parallel_size(model)
    with_entropy = bool(getattr(loss_fn, "needs_entropy", False))
    # Each micro-batch's loss and metrics stay on the device until the last backward is queued:
    # reading them there would make the host wait for that backward before queueing the next forward.
    losses: list[torch.Tensor] = []
    metrics_per_batch: list[tuple[float, Metrics]] = []
    num_real = 0
    num_loss = 0
    with step_collectives(model, len(micro_batches)) as before_micro_batch:
        for index, micro_batch in enumerate(micro_batches):
            before_micro_batch(index)
            batch = micro_batch_to_torch(micro_batch, components.device)
            layout = host_layout(micro_batch, loss_positions_only=True)
            hidden_1_K_H, weight_V_H, kept_K = kept_hidden(model, batch, layout)
            logprobs_B_T, entropy_B_T = logprobs_at(
                hidden_1_K_H,
                weight_V_H,
                kept_K,
                batch,
                temperature=temperature,
                with_entropy=with_entropy,
                top_k=top_k,
                top_p=top_p,
                labels_K=layout.labels,
            )
            kwargs: dict[str, Any] = {"num_tokens": num_tokens, "num_sequences": num_sequences}
            if with_entropy:
                kwargs["entropy_B_T"] = entropy_B_T
            loss, metrics = loss_fn(logprobs_B_T, batch, **kwargs)
            if distill is not None:
                term, divergence = distill_term(
                    distill, micro_batch, layout, hidden_1_K_H, weight_V_H, kept_K, batch, temperature, num_tokens
                )
                loss = loss + term
                metrics = {**metrics, DISTILL_DIVERGENCE_METRIC: divergence}
            # FSDP averages gradients over ranks; the loss already divides by global counts, so
            # scaling by the rank count turns that average into the sum the step needs.
            (loss * num_ranks if num_ranks > 1 else loss).backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            losses.append(loss.detach())
            metrics_per_batch.append((float(max(layout.num_loss_tokens, 1)), metrics))
            num_real += layout.num_real_tokens
            num_loss += layout.num_loss_tokens
    out = _weighted_means(metrics_per_batch)
    out.update(
        loss=sum(floats_of(losses)),  # summed in micro-batch order
        num_micro_batches=float(len(micro_batches)),
        num_real_tokens=float(num_real),
        num_loss_tokens=float(num_loss),
    )
    return out


def _weighted_means(metrics_per_batch: Sequence[tuple[float, Metrics]]) -> dict[str, float]:
    """Each metric's mean over micro-batches, weighted; the tensors among them read with one sync per device."""
    values = floats_of([value for _, metrics in metrics_per_batch for value in metrics.values()])
    weighted: dict[str, float] = {}
    weight_total, i = 0.0, 0
    for weight, metrics in metrics_per_batch:
        for key in metrics:
            weighted[key] = weighted.get(key, 0.0) + weight * values[i]
            i += 1
        weight_total += weight
    return {key: value / weight_total for key, value in weighted.items()}


@torch.no_grad()
def compute_logprobs(
    components: TrainingComponents,
    micro_batches: Sequence[MicroBatch[np.ndarray]],
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
) -> list[np.ndarray]:
    """Token-aligned log-probs [B, T] float32 per micro-batch, without gradients (old/ref policy)."""
    model = components.model
    was_training = model.training
    model.eval()
    try:
        flat = []
        for micro_batch in micro_batches:
            batch = micro_batch_to_torch(micro_batch, components.device)
            layout = host_layout(micro_batch, loss_positions_only=False)
            logprobs_B_T, _ = layout_logprobs(
                model, batch, layout, temperature=temperature, with_entropy=False, top_k=top_k, top_p=top_p
            )
            flat.append(logprobs_B_T.float().reshape(-1))
        # One copy to the host after the last forward is queued, not one wait per micro-batch.
        host = torch.cat(flat).cpu().numpy()
        shapes = [np.shape(mb.input_ids) for mb in micro_batches]
        ends = np.cumsum([math.prod(shape) for shape in shapes])
        return [part.reshape(shape) for part, shape in zip(np.split(host, ends[:-1]), shapes, strict=True)]
    finally:
        model.train(was_training)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly distributed one (DTensor: gathered)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _non_finite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of parameters whose (local) gradient holds a NaN or infinity."""
    bad = []
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if not bool(torch.isfinite(local).all()):
            bad.append(name)
    return bad


def optim_step(
    components: TrainingComponents,
    state: TrainingState,
    config: OptimizerConfig,
    *,
    num_tokens: int = 0,
    num_samples: int = 0,
    loss: float | None = None,
) -> tuple[TrainingState, dict[str, float]]:
    """Clip, step the optimizer and scheduler, zero grads; skip (and count) a non-finite step.

    `num_tokens` / `num_samples` are the step's loss tokens and samples (added to the state);
    `loss`, when given, is checked too. Raises NonFiniteError once `config.max_consecutive_skips`
    steps in a row were skipped.
    """
    model, optimizer = components.model, components.optimizer
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    max_norm = math.inf if config.max_grad_norm is None else config.max_grad_norm
    # The norm is checked before clipping: clipping by a NaN norm would spread the NaN into
    # every gradient and hide which parameter produced it.
    # foreach=None: torch's multi-tensor kernels where the device has them (CUDA), else the loop.
    total_norm = (
        torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=None) if params else None
    )
    grad_norm = float(_full(total_norm)) if total_norm is not None else 0.0
    lr = float(optimizer.param_groups[0]["lr"])
    loss_finite = loss is None or math.isfinite(loss)
    if math.isfinite(grad_norm) and loss_finite:
        if total_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach=None)
        optimizer.step()
        components.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        new_state = state.after_step(num_tokens=num_tokens, num_samples=num_samples)
        return new_state, {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0, "step": float(new_state.step)}
    bad = _non_finite_parameters(model)
    optimizer.zero_grad(set_to_none=True)
    new_state = state.after_skip()
    if new_state.consecutive_skipped_steps >= config.max_consecutive_skips:
        what = []
        if not loss_finite:
            what.append(f"loss {loss}")
        if bad:
            listed = ", ".join(bad[:_MAX_NAMED_PARAMETERS])
            more = f" and {len(bad) - _MAX_NAMED_PARAMETERS} more" if len(bad) > _MAX_NAMED_PARAMETERS else ""
            what.append(f"gradient of {len(bad)} parameter(s): {listed}{more}")
        elif not math.isfinite(grad_norm):
            what.append(f"gradient norm {grad_norm} (on another rank's shard)")
        raise NonFiniteError(
            f"{new_state.consecutive_skipped_steps} consecutive optimizer steps skipped "
            f"(max_consecutive_skips={config.max_consecutive_skips}) at step {state.step}: "
            f"non-finite {'; '.join(what)}. The weights were not updated by these steps."
        )
    return new_state, {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0, "step": float(new_state.step)}
