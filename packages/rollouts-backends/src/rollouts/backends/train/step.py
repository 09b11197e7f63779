"""Training as functions: forward_backward accumulates gradients, optim_step applies them.

Legend: B sequences (rows), T tokens, H hidden size, V vocabulary, S sequences in a micro-batch.

Micro-batches are `rollouts.types.MicroBatch` of numpy arrays (rollouts-data builds them):
input_ids, position_ids, segment_ids, attention_mask [B, T] int and loss_mask [B, T] float, in
padded (B rows) or packed (B == 1, sequences concatenated) layout, plus optional per-token float
arrays (advantages, old/ref/rollout logprobs, extras); `micro_batch_to_torch` checks and moves them. Attention is restricted to each sequence by
an explicit block-diagonal causal mask built from `segment_ids`, so packing never lets one
sequence see another, whatever the transformers version does with restarting position_ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollouts.backends.train.components import TrainingComponents
from rollouts.backends.train.distributed import data_parallel_size
from rollouts.losses import LossFn, fused_token_logprobs
from rollouts.types import MicroBatch, OptimizerConfig, TrainingState

__all__ = [
    "NonFiniteError",
    "attention_mask_4d",
    "compute_logprobs",
    "forward_backward",
    "micro_batch_to_torch",
    "optim_step",
    "token_logprobs_of_model",
]

_INT_FIELDS = ("input_ids", "position_ids", "segment_ids", "attention_mask", "sample_indices", "cu_seqlens")
_MAX_NAMED_PARAMETERS = 5
"""How many offending parameter names a non-finite error lists (the rest are counted)."""


class NonFiniteError(FloatingPointError):
    """Raised when too many optimizer steps in a row had a non-finite loss or gradient."""


def micro_batch_to_torch(micro_batch: MicroBatch[np.ndarray], device: torch.device) -> MicroBatch[torch.Tensor]:
    """Check a micro-batch's array types and move it to `device` (ints as int64, floats as float32)."""
    if not isinstance(micro_batch, MicroBatch):
        raise TypeError(f"micro-batch must be a rollouts.types.MicroBatch, got {type(micro_batch).__name__}")
    shape = np.shape(micro_batch.input_ids)
    if len(shape) != 2 or shape[1] < 2:
        raise ValueError(f"micro-batch input_ids must be [B, T] with T >= 2, got shape {shape}")

    device = torch.device(device)
    pinned = device.type == "cuda"

    def to_torch(name: str, value: np.ndarray) -> torch.Tensor:
        array = np.asarray(value)
        if name in _INT_FIELDS:
            if not np.issubdtype(array.dtype, np.integer):
                raise TypeError(f"micro-batch {name!r} must be an integer array, got {array.dtype}")
            dtype: torch.dtype | None = torch.long
        elif np.issubdtype(array.dtype, np.floating):
            dtype = torch.float32
        else:
            dtype = None
        if not pinned:
            return torch.as_tensor(array, dtype=dtype, device=device)
        # Through page-locked memory (torch's caching host allocator), without waiting: a copy
        # from pageable memory waits for every kernel queued before it, so each micro-batch
        # would drain the GPU's queue before its forward could be queued.
        host = torch.as_tensor(array, dtype=dtype).pin_memory()
        return host.to(device, non_blocking=True)

    return micro_batch.map(to_torch)


@dataclass(frozen=True, slots=True)
class _Layout:
    """What the forward needs to know of a micro-batch's layout, found on the host: on a GPU each
    of these read from device tensors would wait for the queued kernels (several per micro-batch)."""

    one_sequence_per_row: bool
    all_real: bool
    """No padding anywhere."""
    kept: np.ndarray
    """[K] int64: the flat index b * T + t of every position t (of [B, T - 1]) whose next token gets
    a log-prob, row-major; the token predicted is at b * T + t + 1."""
    num_loss_tokens: int
    num_real_tokens: int


def _layout(
    position_ids: np.ndarray,
    attention_mask: np.ndarray,
    segment_ids: np.ndarray,
    loss_mask: np.ndarray,
    *,
    loss_positions_only: bool,
) -> _Layout:
    t = position_ids.shape[1]
    # Token t + 1 is predicted from position t of the same sequence: no prediction at a sequence
    # start (position 0, which in packed rows follows another sequence's last token) or padding.
    keep_B_T = (position_ids[:, 1:] > 0) & (attention_mask[:, 1:] > 0)
    if loss_positions_only:
        on_loss = keep_B_T & (loss_mask[:, 1:] > 0)
        if on_loss.any():
            keep_B_T = on_loss
    rows, cols = np.nonzero(keep_B_T)
    return _Layout(
        one_sequence_per_row=_one_sequence_per_row(position_ids, segment_ids),
        all_real=bool((attention_mask != 0).all()),
        kept=(rows * t + cols).astype(np.int64),
        num_loss_tokens=int((loss_mask > 0).sum()),
        num_real_tokens=int(attention_mask.sum()),
    )


def _one_sequence_per_row(position_ids: np.ndarray, segment_ids: np.ndarray) -> bool:
    real_B_T = segment_ids >= 0
    return bool(
        (real_B_T[:, 1:] <= real_B_T[:, :-1]).all()
        and ((segment_ids == segment_ids[:, :1]) | ~real_B_T).all()
        and ((position_ids == np.arange(position_ids.shape[1])) | ~real_B_T).all()
    )


def _host(array: Any) -> np.ndarray:
    return array.detach().cpu().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)


def _host_layout(micro_batch: MicroBatch[Any], *, loss_positions_only: bool) -> _Layout:
    """The layout of a numpy micro-batch, or of a torch one (copied to the host first)."""
    return _layout(
        _host(micro_batch.position_ids),
        _host(micro_batch.attention_mask),
        _host(micro_batch.segment_ids),
        _host(micro_batch.loss_mask),
        loss_positions_only=loss_positions_only,
    )


def attention_mask_4d(segment_ids_B_T: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, 1, T, T] causal mask within each segment (bool, or additive `dtype`); padding sees itself only."""
    T = segment_ids_B_T.shape[1]
    seg_q = segment_ids_B_T[:, :, None]
    seg_k = segment_ids_B_T[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids_B_T.device).tril()
    allowed = (seg_q == seg_k) & (seg_k >= 0) & causal
    # A padding query with no visible key would softmax over nothing (NaN that leaks into grads
    # through 0 * NaN); letting every token see itself keeps padding rows finite and inert.
    allowed |= torch.eye(T, dtype=torch.bool, device=segment_ids_B_T.device)
    allowed = allowed[:, None]
    if dtype is None:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def packed_only(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes no dense mask (flash kernels): packed rows without padding only.

    Transformers then derives each sequence's boundaries from position_ids restarting at 0.
    """
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    return impl.startswith(("flash", "kernels"))


def one_sequence_per_row(batch: MicroBatch[torch.Tensor]) -> bool:
    """Whether each row holds one sequence from position 0, then only right padding.

    Plain causal attention is then exact for every real token (a real token sees no padding, which
    comes after it), so no [B, 1, T, T] mask is needed and SDPA takes its causal kernel.
    """
    return _one_sequence_per_row(_host(batch.position_ids), _host(batch.segment_ids))


def _model_inputs(
    model: torch.nn.Module, batch: MicroBatch[torch.Tensor], layout: _Layout | None = None
) -> dict[str, Any]:
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if layout is None:
        layout = _host_layout(batch, loss_positions_only=False)
    if not packed_only(model) and layout.one_sequence_per_row:
        # Positions 0..T-1 on padding too: position ids restarting at 0 would read as packing. One
        # row of them, broadcast over the batch: the rotary angles are computed once, not per row.
        positions_1_T = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)[None]
        return {"input_ids": batch.input_ids, "position_ids": positions_1_T, "attention_mask": None}
    if packed_only(model):
        if not layout.all_real:
            raise ValueError(f"attn_implementation {impl!r} needs the packed layout without padding")
        mask = None
    elif impl == "sdpa":
        mask = attention_mask_4d(batch.segment_ids)
    else:
        mask = attention_mask_4d(batch.segment_ids, dtype=next(model.parameters()).dtype)
    return {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "attention_mask": mask}


def _final_hidden(
    model: torch.nn.Module, batch: MicroBatch[torch.Tensor], layout: _Layout | None = None
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
        weight.append(module.weight)

    handles = [
        model.base_model.register_forward_hook(keep_hidden),
        model.get_output_embeddings().register_forward_pre_hook(keep_weight),
    ]
    try:
        no_positions = torch.empty(0, dtype=torch.long, device=batch.input_ids.device)
        model(**_model_inputs(model, batch, layout), use_cache=False, logits_to_keep=no_positions)
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
    layout = _host_layout(batch, loss_positions_only=loss_positions_only)
    return _token_logprobs(
        model, batch, layout, temperature=temperature, with_entropy=with_entropy, top_k=top_k, top_p=top_p
    )


def _token_logprobs(
    model: torch.nn.Module,
    batch: MicroBatch[torch.Tensor],
    layout: _Layout,
    *,
    temperature: float,
    with_entropy: bool,
    top_k: int,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs_of_model` given the batch's layout, with no wait on the device."""
    hidden_B_T_H, weight_V_H = _final_hidden(model, batch, layout)
    b, t, h = hidden_B_T_H.shape
    kept_K = torch.from_numpy(layout.kept)
    if kept_K.device != hidden_B_T_H.device:
        kept_K = kept_K.pin_memory().to(hidden_B_T_H.device, non_blocking=True)
    hidden_1_K_H = hidden_B_T_H.reshape(b * t, h).index_select(0, kept_K)[None]
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
        logprobs_1_K = result
        _, entropy_1_K = fused_token_logprobs(
            hidden_1_K_H, weight_V_H, labels_1_K, temperature=temperature, return_entropy=True
        )
    else:
        logprobs_1_K, entropy_1_K = result if with_entropy else (result, None)
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
) -> dict[str, float]:
    """Forward and backward over a step's micro-batches; gradients accumulate in the model.

    `num_tokens` / `num_sequences` are the loss-token and sequence counts of the WHOLE step (all
    micro-batches, all ranks), so the summed micro-batch gradients equal one big batch's.
    Metrics: `loss` is the step's loss (sum over micro-batches); the loss function's metrics are
    averaged over micro-batches weighted by their loss tokens.
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
    loss_total = 0.0
    weighted: dict[str, float] = {}
    weight_total = 0.0
    num_real = 0
    num_loss = 0
    for micro_batch in micro_batches:
        batch = micro_batch_to_torch(micro_batch, components.device)
        layout = _host_layout(micro_batch, loss_positions_only=True)
        logprobs_B_T, entropy_B_T = _token_logprobs(
            model, batch, layout, temperature=temperature, with_entropy=with_entropy, top_k=top_k, top_p=top_p
        )
        kwargs: dict[str, Any] = {"num_tokens": num_tokens, "num_sequences": num_sequences}
        if with_entropy:
            kwargs["entropy_B_T"] = entropy_B_T
        loss, metrics = loss_fn(logprobs_B_T, batch, **kwargs)
        # FSDP averages gradients over ranks; the loss already divides by global counts, so
        # scaling by the rank count turns that average into the sum the step needs.
        (loss * num_ranks if num_ranks > 1 else loss).backward()
        loss_total += float(loss.detach())
        weight = float(max(layout.num_loss_tokens, 1))
        for key, value in metrics.items():
            weighted[key] = weighted.get(key, 0.0) + weight * float(value)
        weight_total += weight
        num_real += layout.num_real_tokens
        num_loss += layout.num_loss_tokens
    out = {key: value / weight_total for key, value in weighted.items()}
    out.update(
        loss=loss_total,
        num_micro_batches=float(len(micro_batches)),
        num_real_tokens=float(num_real),
        num_loss_tokens=float(num_loss),
    )
    return out


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
        out = []
        for micro_batch in micro_batches:
            batch = micro_batch_to_torch(micro_batch, components.device)
            layout = _host_layout(micro_batch, loss_positions_only=False)
            logprobs_B_T, _ = _token_logprobs(
                model, batch, layout, temperature=temperature, with_entropy=False, top_k=top_k, top_p=top_p
            )
            out.append(logprobs_B_T.float().cpu().numpy())
        return out
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
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=None) if params else None
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
