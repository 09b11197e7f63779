"""Document-masked attention for packed rows: FlexAttention with a block mask built from segment_ids.

Legend: B rows, T tokens, H heads, D head size.

A packed row holds several sequences end to end. Through SDPA it needs a dense [B, 1, T, T] mask,
and the kernel computes every query-key pair of the row, across sequences too, only to mask most
of them away. `DOCUMENT_SDPA` is a transformers attention implementation that runs FlexAttention
when the mask is a `BlockMask` (`document_block_mask`: causal within each sequence), which skips
every block of pairs the mask rules out, and transformers' SDPA for every other mask (None,
dense), so padded rows, prefill and decode run exactly as under "sdpa". `register()` registers it
with transformers (once); `rollouts.backends.build_components` and `load_hf_model` call it when they
choose it for "sdpa" models on CUDA.

Importing this module costs nothing beyond torch: FlexAttention (which imports torch's compiler
stack) and transformers' attention registry are imported when first used, so a process that never
attends through a BlockMask (every CPU run, an engine process) never pays for them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["DOCUMENT_SDPA", "SDPA_IMPLEMENTATIONS", "document_block_mask", "document_sdpa_forward", "register"]

DOCUMENT_SDPA = "sdpa_document"
"""The attention implementation's name (it contains "sdpa": transformers checks SDPA support for it)."""
SDPA_IMPLEMENTATIONS = ("sdpa", DOCUMENT_SDPA)
"""Implementations that run torch's SDPA for every mask but a BlockMask."""


def document_block_mask(segment_ids_B_T: torch.Tensor) -> BlockMask:
    """A BlockMask of causal attention within each segment; padding (segment -1) sees itself only,
    as in `rollouts.backends.train.inputs.attention_mask_4d`."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, t = segment_ids_B_T.shape

    def within_segment(b_: torch.Tensor, h_: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        seg_q, seg_kv = segment_ids_B_T[b_, q], segment_ids_B_T[b_, kv]
        return ((seg_q == seg_kv) & (seg_kv >= 0) & (q >= kv)) | (q == kv)

    return create_block_mask(within_segment, B=b, H=None, Q_LEN=t, KV_LEN=t, device=segment_ids_B_T.device)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    # Eager FlexAttention materialises the scores; compiled, it is a fused kernel that skips masked blocks.
    return cast(Callable[..., torch.Tensor], torch.compile(flex_attention))


def document_sdpa_forward(
    module: torch.nn.Module,
    query_B_H_T_D: torch.Tensor,
    key_B_H_T_D: torch.Tensor,
    value_B_H_T_D: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: ([B, T, H, D] output, None)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, BlockMask):
        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module,
            query_B_H_T_D,
            key_B_H_T_D,
            value_B_H_T_D,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            **kwargs,
        )
        return out
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported with packed rows under {DOCUMENT_SDPA!r}")
    flex = _compiled_flex() if query_B_H_T_D.is_cuda else cast(Callable[..., torch.Tensor], flex_attention)
    out_B_H_T_D = flex(
        query_B_H_T_D,
        key_B_H_T_D,
        value_B_H_T_D,
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=query_B_H_T_D.shape[1] != key_B_H_T_D.shape[1],
    )
    return out_B_H_T_D.transpose(1, 2).contiguous(), None


@functools.cache
def register() -> str:
    """Register DOCUMENT_SDPA with transformers (once; before a model loads with it or switches to
    it) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DOCUMENT_SDPA, document_sdpa_forward)
    # transformers builds the masks it makes itself (from a 2-D padding mask, in generation) as for SDPA.
    AttentionMaskInterface.register(DOCUMENT_SDPA, sdpa_mask)
    return DOCUMENT_SDPA
