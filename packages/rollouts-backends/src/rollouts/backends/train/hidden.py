"""The model's last hidden state at the positions that predict a token, and the log-probs it gives.

Legend: B sequences (rows), T tokens, H hidden size, V vocabulary, K kept positions.

The output projection never runs inside the model's forward: the log-probs (and any other function
of the logits) are computed from the last hidden state at the positions that need one, chunk by
chunk, so the full [B, T, V] logits never exist.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch

from rollouts.backends.train.components import model_attr
from rollouts.backends.train.inputs import HostLayout, host_layout, model_inputs
from rollouts.losses import fused_token_logprobs
from rollouts.types import MicroBatch

__all__ = ["kept_hidden", "layout_logprobs", "logprobs_at", "token_logprobs_of_model"]


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
    return layout_logprobs(
        model, batch, layout, temperature=temperature, with_entropy=with_entropy, top_k=top_k, top_p=top_p
    )


def kept_hidden(
    model: torch.nn.Module, batch: MicroBatch[torch.Tensor], layout: HostLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([1, K, H] last hidden state at the layout's kept positions, [V, H] output projection, [K] kept).
    The batch's ids are checked against the model's vocabulary on the host first."""
    rows = [model_attr(model, "get_output_embeddings")().weight.shape[0]]
    input_embeddings = getattr(model, "get_input_embeddings", None)  # a wrapper may show the output side alone
    if input_embeddings is not None:
        rows.append(input_embeddings().weight.shape[0])
    layout.check_vocabulary(min(rows))
    hidden_B_T_H, weight_V_H = _final_hidden(model, batch, layout)
    b, t, h = hidden_B_T_H.shape
    kept_K = torch.from_numpy(layout.kept)
    if kept_K.device != hidden_B_T_H.device:
        kept_K = kept_K.pin_memory().to(hidden_B_T_H.device, non_blocking=True)
    return hidden_B_T_H.reshape(b * t, h).index_select(0, kept_K)[None], weight_V_H, kept_K


def layout_logprobs(
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
    hidden_1_K_H, weight_V_H, kept_K = kept_hidden(model, batch, layout)
    return logprobs_at(
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


def logprobs_at(
    hidden_1_K_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    kept_K: torch.Tensor,
    batch: MicroBatch[torch.Tensor],
    *,
    temperature: float,
    with_entropy: bool,
    top_k: int,
    top_p: float,
    labels_K: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log-probs (and entropy) of the tokens predicted from the kept positions' hidden states.
    `labels_K`: those tokens on the host (HostLayout.labels): checked there and copied to the device
    without a wait (checked on the device, they would be read back: a wait for the forward)."""
    b, t = batch.input_ids.shape
    labels_1_K = torch.from_numpy(labels_K)[None]
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
