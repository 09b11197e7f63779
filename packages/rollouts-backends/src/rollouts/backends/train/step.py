"""Training as functions: forward_backward accumulates gradients, optim_step applies them.

Legend: B sequences (rows), T tokens, H hidden size, V vocabulary, S sequences in a micro-batch.

Micro-batches are `rollouts.types.MicroBatch` of numpy arrays (rollouts-data builds them); how
they are checked, moved and laid out for the model is in rollouts.backends.train.inputs. The
log-probs are computed from the last hidden state at the positions that need one, chunk by
chunk, so the full [B, T, V] logits never exist.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from rollouts.backends.train.components import TrainingComponents, model_attr
from rollouts.backends.train.distributed import data_parallel_size
from rollouts.backends.train.inputs import HostLayout, host_layout, micro_batch_to_torch, model_inputs
from rollouts.losses import LossFn, Metrics, check_beta, floats_of, fused_distill_divergence, fused_token_logprobs
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


DISTILL_DIVERGENCE_METRIC = "distill/divergence"
"""forward_backward's metric with a DistillTerm: the divergence's mean over the loss tokens."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DistillTerm:
    """A term forward_backward adds to the loss: `coef` times the divergence between the model's
    next-token distribution and a frozen teacher's, over the whole vocabulary, at every loss token
    (rollouts.losses.fused_distill_divergence: `beta` 1 reverse KL, 0 forward KL, between GKD's
    generalized JSD), weighted by the loss mask and divided by the step's `num_tokens`.

    The teacher runs one forward per micro-batch, without gradients, on the same inputs (under
    FSDP every rank runs it the same number of times, as the reference model). Its vocabulary
    must be the model's. The model's distribution is its softmax at forward_backward's
    temperature (top-k / top-p truncation does not apply to it); the teacher's at temperature 1.
    """

    teacher: TrainingComponents
    coef: float = 1.0
    beta: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.teacher, TrainingComponents):
            raise TypeError(f"DistillTerm.teacher must be TrainingComponents, got {type(self.teacher).__name__}")
        if isinstance(self.coef, bool) or not isinstance(self.coef, (int, float)) or not math.isfinite(self.coef):
            raise ValueError(f"DistillTerm.coef must be a finite number, got {self.coef!r}")
        if self.coef <= 0:
            raise ValueError(f"DistillTerm.coef must be > 0, got {self.coef}")
        check_beta(self.beta)


def _final_hidden(
    model: torch.nn.Module, batch: MicroBatch[torch.Tensor], layout: HostLayout | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, H] last hidden state (after the final norm) and [V, H] output projection weight.

    The full forward runs (so FSDP's hooks gather and later reduce every parameter) but the
    output projection sees zero positions: logits are computed afterwards, chunk by chunk. The
    weight is taken as the projection saw it (under FSDP2: the gathered, unsharded tensor).
    """
    hidden: list[torch.Tensor] = []
    weight: list[torch.Tensor] = []

    def keep_hidden(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        hidden.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    def keep_weight(module: torch.nn.Module, _args: Any) -> None:
        weight.append(cast(torch.Tensor, module.weight))  # a Linear's (or tied embedding's) weight

    handles = [
        model_attr(model, "base_model").register_forward_hook(keep_hidden),
        model_attr(model, "get_output_embeddings")().register_forward_pre_hook(keep_weight),
    ]
    try:
        no_positions = torch.empty(0, dtype=torch.long, device=batch.input_ids.device)
        model(**model_inputs(model, batch, layout), use_cache=False, logits_to_keep=no_positions)
    finally:
        for handle in handles:
            handle.remove()
    assert len(hidden) == 1 and len(weight) == 1, "the base model and the output projection ran once"
    return hidden[0], weight[0]


def token_logprobs_of_model(
    model: torch.nn.Module,
    batch: MicroBatch[torch.Tensor],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    top_k: int = -1,
    top_p: float = 1.0,
    loss_positions_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log p(token t | tokens < t) (0 at sequence starts and padding), and entropy if asked.

    `top_k` / `top_p`: log-probs of the truncated, renormalised distribution a sampler with those
    settings draws from (the entropy stays the full softmax's).
    `loss_positions_only`: the output layer runs only for tokens the loss mask covers (the others
    read 0): prompts carry no loss, so a loss needs nothing else and skips their logits.
    """
    layout = host_layout(batch, loss_positions_only=loss_positions_only)
    return _token_logprobs(
        model, batch, layout, temperature=temperature, with_entropy=with_entropy, top_k=top_k, top_p=top_p
    )


def _kept_hidden(
    model: torch.nn.Module, batch: MicroBatch[torch.Tensor], layout: HostLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([1, K, H] last hidden state at the layout's kept positions, [V, H] output projection, [K] kept)."""
    hidden_B_T_H, weight_V_H = _final_hidden(model, batch, layout)
    b, t, h = hidden_B_T_H.shape
    kept_K = torch.from_numpy(layout.kept)
    if kept_K.device != hidden_B_T_H.device:
        kept_K = kept_K.pin_memory().to(hidden_B_T_H.device, non_blocking=True)
    return hidden_B_T_H.reshape(b * t, h).index_select(0, kept_K)[None], weight_V_H, kept_K


def _token_logprobs(
    model: torch.nn.Module,
    batch: MicroBatch[torch.Tensor],
    layout: HostLayout,
    *,
    temperature: float,
    with_entropy: bool,
    top_k: int,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs_of_model` given the batch's layout, with no wait on the device."""
    hidden_1_K_H, weight_V_H, kept_K = _kept_hidden(model, batch, layout)
    return _logprobs_at(
        hidden_1_K_H,
        weight_V_H,
        kept_K,
        batch,
        temperature=temperature,
        with_entropy=with_entropy,
        top_k=top_k,
        top_p=top_p,
    )


def _logprobs_at(
    hidden_1_K_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    kept_K: torch.Tensor,
    batch: MicroBatch[torch.Tensor],
    *,
    temperature: float,
    with_entropy: bool,
    top_k: int,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log-probs (and entropy) of the tokens predicted from the kept positions' hidden states."""
    b, t = batch.input_ids.shape
    labels_1_K = batch.input_ids.reshape(b * t).index_select(0, kept_K + 1)[None]
    truncated = top_k > 0 or top_p < 1.0
    result = fused_token_logprobs(
        hidden_1_K_H,
        weight_V_H,
        labels_1_K,
        temperature=temperature,
        return_entropy=with_entropy and not truncated,
        top_k=top_k,
        top_p=top_p,
    )
    if truncated and with_entropy:
        logprobs_1_K = cast(torch.Tensor, result)  # return_entropy was off: log-probs alone
        _, entropy_1_K = fused_token_logprobs(
            hidden_1_K_H, weight_V_H, labels_1_K, temperature=temperature, return_entropy=True
        )
    elif with_entropy:
        logprobs_1_K, entropy_1_K = cast(tuple[torch.Tensor, torch.Tensor], result)
    else:
        logprobs_1_K, entropy_1_K = cast(torch.Tensor, result), None
    logprobs_B_T = _scatter_kept(logprobs_1_K, kept_K, b, t)
    return logprobs_B_T, None if entropy_1_K is None else _scatter_kept(entropy_1_K, kept_K, b, t)


def _scatter_kept(values_1_K: torch.Tensor, kept_K: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """[B, T]: values_1_K at the predicted positions (kept_K + 1, flat), 0 elsewhere."""
    return values_1_K.new_zeros(b * t).index_copy(0, kept_K + 1, values_1_K[0]).view(b, t)


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
    for micro_batch in micro_batches:
        batch = micro_batch_to_torch(micro_batch, components.device)
        layout = host_layout(micro_batch, loss_positions_only=True)
        hidden_1_K_H, weight_V_H, kept_K = _kept_hidden(model, batch, layout)
        logprobs_B_T, entropy_B_T = _logprobs_at(
            hidden_1_K_H,
            weight_V_H,
            kept_K,
            batch,
            temperature=temperature,
            with_entropy=with_entropy,
            top_k=top_k,
            top_p=top_p,
        )
        kwargs: dict[str, Any] = {"num_tokens": num_tokens, "num_sequences": num_sequences}
        if with_entropy:
            kwargs["entropy_B_T"] = entropy_B_T
        loss, metrics = loss_fn(logprobs_B_T, batch, **kwargs)
        if distill is not None:
            term, divergence = _distill_term(
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


def _distill_term(
    distill: DistillTerm,
    micro_batch: MicroBatch[np.ndarray],
    layout: HostLayout,
    hidden_1_K_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    kept_K: torch.Tensor,
    batch: MicroBatch[torch.Tensor],
    temperature: float,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the micro-batch's distillation loss term, its mean divergence over its loss tokens, detached)."""
    teacher = distill.teacher.model
    on_teacher = (
        batch
        if distill.teacher.device == hidden_1_K_H.device
        else micro_batch_to_torch(micro_batch, distill.teacher.device)
    )
    was_training = teacher.training
    teacher.eval()
    try:
        with torch.no_grad():
            teacher_1_K_G, teacher_V_G, _ = _kept_hidden(teacher, on_teacher, layout)
    finally:
        teacher.train(was_training)
    divergence_K = fused_distill_divergence(
        hidden_1_K_H[0],
        weight_V_H,
        teacher_1_K_G[0].to(hidden_1_K_H.device),
        teacher_V_G.to(hidden_1_K_H.device),
        beta=distill.beta,
        temperature=temperature,
    )
    mask_K = batch.loss_mask.reshape(-1).index_select(0, kept_K + 1).to(divergence_K.dtype)
    weighted = (mask_K * divergence_K).sum()
    mean = weighted.detach() / mask_K.sum().clamp(min=1.0)
    return distill.coef * weighted / max(num_tokens, 1), mean


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
            logprobs_B_T, _ = _token_logprobs(
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
