"""A micro-batch's way into the model: its arrays checked and moved to the device, its layout read
on the host, and the model's inputs (ids, positions and the attention mask) built from both.

Legend: B sequences (rows), T tokens.

Micro-batches are `rollouts.types.MicroBatch` of numpy arrays (rollouts-data builds them):
input_ids, position_ids, segment_ids, attention_mask [B, T] int and loss_mask [B, T] float, in
padded (B rows) or packed (B == 1, sequences concatenated) layout, plus optional per-token float
arrays (advantages, old/ref/rollout logprobs, extras). Attention is restricted to each sequence by
an explicit block-diagonal causal mask built from `segment_ids`, so packing never lets one
sequence see another, whatever the transformers version does with restarting position_ids: a
dense [B, 1, T, T] mask under "sdpa" and "eager" (and on CPU), a FlexAttention BlockMask under
DOCUMENT_SDPA on CUDA (rollouts.backends.train.attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rollouts.backends.train.attention import DOCUMENT_SDPA, SDPA_IMPLEMENTATIONS, document_block_mask
from rollouts.types import MicroBatch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "HostLayout",
    "attention_mask_4d",
    "document_masked",
    "host_layout",
    "micro_batch_to_torch",
    "model_inputs",
    "one_sequence_per_row",
    "packed_only",
]

_INT_FIELDS = ("input_ids", "position_ids", "segment_ids", "attention_mask", "sample_indices", "cu_seqlens")


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
class HostLayout:
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
    labels: np.ndarray
    """[K] int64: the token predicted from each kept position (input_ids' b * T + t + 1)."""
    token_ids: tuple[int, int]
    """The lowest and the highest of input_ids ((0, 0) for none)."""

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise unless every input id lies in [0, vocab_size): checked here on the host, before the
        forward (on a GPU a bad id is a device-side assert, and a check of the device's ids a wait)."""
        low, high = self.token_ids
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"input_ids must lie in [0, {vocab_size}) (the model's vocabulary), got values in [{low}, {high}]"
            )


def _layout(
    input_ids: np.ndarray,
    position_ids: np.ndarray,
    attention_mask: np.ndarray,
    segment_ids: np.ndarray,
    loss_mask: np.ndarray,
    *,
    loss_positions_only: bool,
) -> HostLayout:
    t = position_ids.shape[1]
    # Token t + 1 is predicted from position t of the same sequence: no prediction at a sequence
    # start (position 0, which in packed rows follows another sequence's last token) or padding.
    keep_B_T = (position_ids[:, 1:] > 0) & (attention_mask[:, 1:] > 0)
    if loss_positions_only:
        on_loss = keep_B_T & (loss_mask[:, 1:] > 0)
        if on_loss.any():
            keep_B_T = on_loss
    rows, cols = np.nonzero(keep_B_T)
    kept = (rows * t + cols).astype(np.int64)
    return HostLayout(
        one_sequence_per_row=_one_sequence_per_row(position_ids, segment_ids),
        all_real=bool((attention_mask != 0).all()),
        kept=kept,
        num_loss_tokens=int((loss_mask > 0).sum()),
        num_real_tokens=int(attention_mask.sum()),
        labels=input_ids.reshape(-1)[kept + 1].astype(np.int64),
        token_ids=(int(input_ids.min()), int(input_ids.max())) if input_ids.size else (0, 0),
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


def host_layout(micro_batch: MicroBatch[Any], *, loss_positions_only: bool) -> HostLayout:
    """The layout of a numpy micro-batch, or of a torch one (copied to the host first)."""
    return _layout(
        _host(micro_batch.input_ids),
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


def document_masked(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a packed row on `device` costs attention within its sequences only (flash kernels, or
    DOCUMENT_SDPA's FlexAttention on CUDA), not over the whole row."""
    impl = getattr(model.config, "_attn_implementation", None)
    return packed_only(model) or (impl == DOCUMENT_SDPA and torch.device(device).type == "cuda")


def one_sequence_per_row(batch: MicroBatch[torch.Tensor]) -> bool:
    """Whether each row holds one sequence from position 0, then only right padding.

    Plain causal attention is then exact for every real token (a real token sees no padding, which
    comes after it), so no [B, 1, T, T] mask is needed and SDPA takes its causal kernel.
    """
    return _one_sequence_per_row(_host(batch.position_ids), _host(batch.segment_ids))


def model_inputs(
    model: torch.nn.Module, batch: MicroBatch[torch.Tensor], layout: HostLayout | None = None
) -> dict[str, Any]:
    """input_ids, position_ids and attention_mask for the model's forward (see the module docstring)."""
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if layout is None:
        layout = host_layout(batch, loss_positions_only=False)
    if not packed_only(model) and layout.one_sequence_per_row:
        # Positions 0..T-1 on padding too: position ids restarting at 0 would read as packing. One
        # row of them, broadcast over the batch: the rotary angles are computed once, not per row.
        positions_1_T = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)[None]
        return {"input_ids": batch.input_ids, "position_ids": positions_1_T, "attention_mask": None}
    mask: torch.Tensor | BlockMask | None
    if packed_only(model):
        if not layout.all_real:
            raise ValueError(f"attn_implementation {impl!r} needs the packed layout without padding")
        mask = None
    elif impl == DOCUMENT_SDPA and batch.segment_ids.is_cuda:
        mask = document_block_mask(batch.segment_ids)
    elif impl in SDPA_IMPLEMENTATIONS:  # FlexAttention has no backward on CPU: the dense mask there
        mask = attention_mask_4d(batch.segment_ids)
    else:
        mask = attention_mask_4d(batch.segment_ids, dtype=next(model.parameters()).dtype)
    return {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "attention_mask": mask}
