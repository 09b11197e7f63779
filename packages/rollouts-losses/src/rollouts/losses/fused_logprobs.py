"""Log-probabilities and entropy straight from hidden states and the output projection, never holding
the logits: `fused_token_logprobs`, and `fused_block_shape`, the C x U blocks it works in by default.
The torch kernel is in fused_kernel.py, the Triton one in triton_logprobs.py, the top-k / top-p path
in truncated_logprobs.py. The legend and the float32 rule are those of logprobs.py.

Legend: K flattened tokens, C tokens per block, V vocabulary, U vocabulary rows per block, H hidden.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from rollouts.losses.fused_kernel import FusedTokenLogprobs
from rollouts.losses.logprobs import check_chunk_size, check_labels, compute_dtype
from rollouts.losses.truncated_logprobs import truncated_chunk_size, truncated_token_logprobs, truncation_mask

__all__ = [
    "FUSED_MEMORY_BUDGET_BYTES",
    "KERNELS",
    "fused_block_shape",
    "fused_token_logprobs",
    "resolve_matmul_dtype",
    "truncation_mask",
]


FUSED_MEMORY_BUDGET_BYTES = 512 * 2**20
"""Upper bound on the two C x U float32 buffers of `fused_token_logprobs` when their shape is chosen for you."""
FUSED_FRACTION_OF_LOGITS = 8
"""Default buffers hold at most 1/8 of one K x V float32 logits tensor, two blocks of 1/16: naive
log_softmax(h @ W.T).gather holds two or more such tensors through backward (2.1 to 2.6, measured on
CPU), so the buffers stay within 1/16 of naive and the [K, H] terms (the gradient of h and its
operands) fit under the 1/8 goal. A log-probs-only forward leaves its last two blocks in them, which
spares backward 2 of its V / U logit recomputations."""
MIN_VOCAB_BLOCK = 1024
"""Fewest vocabulary rows per block (unless V is smaller): on one CPU thread a [K, H] @ [H, U] matmul
with U = 1024 runs as fast per element as with U = 9496 (measured at K=1024, H=896), and the
per-block work outside the matmuls (the label gather, the running max) is O(K), so 1/U of it."""
MIN_TOKEN_CHUNK = 16
"""Fewest tokens per block (unless K is smaller): below that a matmul loses much of its efficiency."""


def fused_block_shape(
    num_tokens: int, vocab_size: int, *, budget_bytes: int = FUSED_MEMORY_BUDGET_BYTES
) -> tuple[int, int]:
    """(C tokens, U vocabulary rows) per block of `fused_token_logprobs`, which holds two such float32 blocks.

    All K tokens go in one block while that fits (so W is read once per pass and each block's
    gradient is one matmul); U then shrinks as K grows, keeping the two C x U float32 buffers within
    1/8 of the K x V logits and within budget_bytes. U stops at MIN_VOCAB_BLOCK, after which C
    shrinks to stay within the budget, down to MIN_TOKEN_CHUNK.
    """
    if num_tokens < 0 or vocab_size < 1 or budget_bytes < 1:
        raise ValueError(
            f"need num_tokens >= 0, vocab_size >= 1, budget_bytes >= 1, got {num_tokens}, {vocab_size}, {budget_bytes}"
        )
    k, block_bytes = max(num_tokens, 1), 2 * 4  # two float32 buffers
    allowed_bytes = min(budget_bytes, k * vocab_size * 4 // FUSED_FRACTION_OF_LOGITS)
    u = min(vocab_size, max(MIN_VOCAB_BLOCK, allowed_bytes // (block_bytes * k)))
    c = min(k, max(MIN_TOKEN_CHUNK, budget_bytes // (block_bytes * u)))
    return c, u


def _check_options(temperature: float, top_k: int, top_p: float) -> None:
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be > 0 (it divides the logits), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not (top_k == -1 or top_k >= 1):
        raise ValueError(f"top_k must be -1 (off) or an int >= 1, got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def _check_shapes(hidden_B_T_H: Tensor, lm_head_weight_V_H: Tensor, labels_B_T: Tensor) -> None:
    if hidden_B_T_H.dim() != 3 or lm_head_weight_V_H.dim() != 2 or labels_B_T.shape != hidden_B_T_H.shape[:2]:
        raise ValueError(
            f"hidden must be [B, T, H], lm_head_weight [V, H] and labels [B, T], got {tuple(hidden_B_T_H.shape)}, "
            f"{tuple(lm_head_weight_V_H.shape)} and {tuple(labels_B_T.shape)}"
        )
    if hidden_B_T_H.shape[2] != lm_head_weight_V_H.shape[1]:
        raise ValueError(
            f"hidden size {hidden_B_T_H.shape[2]} does not match lm_head_weight [V, H] = {tuple(lm_head_weight_V_H.shape)}"
        )
    check_labels(labels_B_T, lm_head_weight_V_H.shape[0])


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def resolve_matmul_dtype(hidden: Tensor, weight: Tensor, matmul_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `fused_token_logprobs` multiplies h and W in: `matmul_dtype`, checked, or by default
    the inputs' own when both are bf16 (or both fp16) on CUDA, else the float32 (float64) compute dtype."""
    wide = compute_dtype(hidden, weight)
    native = hidden.dtype if hidden.dtype == weight.dtype and hidden.dtype in _LOW_PRECISION else None
    if matmul_dtype is None:
        return native if native is not None and hidden.is_cuda else wide
    if matmul_dtype not in (wide, native):
        allowed = f"{wide}" + (f" or {native}" if native is not None else "")
        raise ValueError(
            f"matmul_dtype must be the compute dtype or, for bf16 / fp16 hidden and weight of one dtype, that dtype: "
            f"got {matmul_dtype} for hidden {hidden.dtype} and weight {weight.dtype} (allowed: {allowed})"
        )
    return matmul_dtype


KERNELS = ("auto", "torch", "triton")
"""The values of `fused_token_logprobs(kernel=...)`."""


def _triton_refusal(hidden: Tensor, weight: Tensor, chunk_size: object, matmul_dtype: torch.dtype | None) -> str:
    """Why the Triton kernel cannot run these inputs and options, or "" when it can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'rollouts-losses[triton]')"
    if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return f"it needs CUDA tensors (or TRITON_INTERPRET=1 for CPU ones), got {hidden.device}"
    if hidden.dtype != weight.dtype or hidden.dtype not in (*_LOW_PRECISION, torch.float32):
        return f"it needs hidden and weight of one dtype among bf16, fp16, float32, got {hidden.dtype}, {weight.dtype}"
    if chunk_size is not None or matmul_dtype not in (None, hidden.dtype):
        return (
            "chunk_size and matmul_dtype are the torch kernel's options (the Triton one multiplies h and W as they are)"
        )
    return ""


def _use_triton(
    kernel: str, hidden: Tensor, weight: Tensor, chunk_size: object, matmul_dtype: torch.dtype | None, truncated: bool
) -> bool:
    """Whether `fused_token_logprobs` runs the Triton kernel: always for "triton" (or a ValueError saying why it
    cannot), for "auto" on bf16 / fp16 CUDA tensors whenever it can."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "torch" or (kernel == "auto" and (truncated or not hidden.is_cuda or hidden.dtype == torch.float32)):
        return False
    refusal = "top_k / top_p truncation ranks whole rows in torch" if truncated else ""
    refusal = refusal or _triton_refusal(hidden, weight, chunk_size, matmul_dtype)
    if refusal and kernel == "triton":
        raise ValueError(f"kernel='triton' cannot run here: {refusal}")
    return not refusal


def _triton_logprobs(
    hidden_K_H: Tensor, weight_V_H: Tensor, labels_K: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    from rollouts.losses.triton_logprobs import TritonTokenLogprobs, default_triton_config  # imports triton

    config = default_triton_config(hidden_K_H.device)
    out: tuple[Tensor, Tensor] = TritonTokenLogprobs.apply(
        hidden_K_H.contiguous(), weight_V_H.contiguous(), labels_K.contiguous(), temperature, with_entropy, config
    )
    return out


def fused_token_logprobs(
    hidden_B_T_H: Tensor,
    lm_head_weight_V_H: Tensor,
    labels_B_T: Tensor,
    *,
    chunk_size: int | tuple[int, int] | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    top_k: int = -1,
    top_p: float = 1.0,
    matmul_dtype: torch.dtype | None = None,
    kernel: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """[B, T, H] hidden, [V, H] output projection, [B, T] labels -> [B, T] log p(label) of softmax(h W.T / temperature).

    With return_entropy, returns ([B, T] log-probs, [B, T] entropy), both differentiable. The
    B x T x V logits are never materialized, in forward or backward.

    `kernel`: "torch" works in blocks of C tokens by U vocabulary rows, `chunk_size=(C, U)` (an
    int sets C alone), by default `fused_block_shape(B * T, V)`, which bounds the extra memory by a
    fraction of naive's at every size; the result does not depend on the block shape beyond float
    rounding. "triton" runs Triton kernels (the `triton` extra; CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1) on bf16, fp16 or float32 h and W of one dtype, multiplied as they are with
    float32 accumulation and float32 logits, as the torch kernel on CUDA; it takes no chunk_size,
    matmul_dtype, top_k or top_p. "auto" (default) is "triton" for bf16 / fp16 CUDA tensors when
    triton is installed and none of those options is given, else "torch".

    `top_k` (> 0) / `top_p` (< 1): the log-probs of the distribution a sampler with those settings
    draws from (`truncation_mask`, renormalised), so importance ratios and KL compare the policy
    that was sampled; this path ranks whole rows, so it chunks tokens only (chunk_size, by default
    1/16 of the tokens) and recomputes each chunk in backward (checkpointed). Not with
    return_entropy or a (C, U) chunk_size.

    `matmul_dtype`: the dtype h and W are multiplied in; the vocabulary-axis arithmetic is float32
    whatever it is. By default, bf16 (fp16) inputs on CUDA are multiplied as they are, on the
    tensor cores, with float32 accumulation and float32 logits; elsewhere they are upcast exactly to
    float32. Pass float32 to upcast on CUDA too (slower), or the inputs' dtype on CPU (the logits
    are then rounded to it, as naive bf16 logits are).

    `labels_B_T` may be on the CPU with `hidden_B_T_H` on a GPU: they are checked there, then copied
    to the GPU without a wait. A check of labels on the GPU reads their min and max on the host,
    which waits for every kernel queued before it (the forward that made `hidden_B_T_H`).
    """
    block_c, block_u = chunk_size if isinstance(chunk_size, tuple) else (chunk_size, None)
    for size in (block_c, block_u):
        if size is not None:
            check_chunk_size(size)
    _check_shapes(hidden_B_T_H, lm_head_weight_V_H, labels_B_T)
    _check_options(temperature, top_k, top_p)
    if labels_B_T.device != hidden_B_T_H.device:
        host = labels_B_T.device.type == "cpu" and hidden_B_T_H.is_cuda
        labels_B_T = (labels_B_T.pin_memory() if host else labels_B_T).to(hidden_B_T_H.device, non_blocking=host)
    truncated = 0 < top_k < lm_head_weight_V_H.shape[0] or top_p < 1.0
    use_triton = _use_triton(kernel, hidden_B_T_H, lm_head_weight_V_H, chunk_size, matmul_dtype, truncated)
    operand_dtype = resolve_matmul_dtype(hidden_B_T_H, lm_head_weight_V_H, matmul_dtype)
    (b, t, h), v = hidden_B_T_H.shape, lm_head_weight_V_H.shape[0]
    hidden_K_H, labels_K = hidden_B_T_H.reshape(b * t, h), labels_B_T.reshape(b * t).long()
    if truncated:
        if return_entropy or block_u is not None or matmul_dtype in _LOW_PRECISION:
            raise ValueError(
                "return_entropy, a (C, U) chunk_size and a low-precision matmul_dtype are not supported with top_k / "
                "top_p truncation (the truncated path ranks whole float32 vocabulary rows)"
            )
        c = block_c or truncated_chunk_size(b * t, v, FUSED_MEMORY_BUDGET_BYTES)
        logprobs_K = truncated_token_logprobs(
            hidden_K_H, lm_head_weight_V_H, labels_K, c, float(temperature), top_k, float(top_p)
        )
        return logprobs_K.view(b, t)
    fused: tuple[Tensor, Tensor]
    if use_triton:
        fused = _triton_logprobs(hidden_K_H, lm_head_weight_V_H, labels_K, float(temperature), return_entropy)
    else:
        auto_c, auto_u = fused_block_shape(b * t, v)
        block_shape = (block_c or auto_c, block_u or auto_u)
        fused = FusedTokenLogprobs.apply(
            hidden_K_H, lm_head_weight_V_H, labels_K, block_shape, float(temperature), return_entropy, operand_dtype
        )
    logprobs_K, entropy_K = fused
    if return_entropy:
        return logprobs_K.view(b, t), entropy_K.view(b, t)
    return logprobs_K.view(b, t)
