"""Per-token log-probabilities and entropy without a second B x T x V tensor.

Legend: B sequences, T tokens, V vocabulary, H hidden, K = B * T flattened tokens, C tokens per chunk.

The vocabulary axis dominates RL memory (V = 151936 for Qwen2), so every function here walks the
tokens in chunks of C and keeps at most a couple of C x V buffers alive. `fused_token_logprobs`
goes further and never holds the logits at all: its backward recomputes each chunk's logits from
the hidden states (one extra matmul) instead of storing them (it lives in fused_logprobs.py), and it
works in blocks of tokens by vocabulary rows whose shape adapts to K and V (`fused_block_shape`),
so its extra memory stays a small fraction of naive's at every size. All
arithmetic on the vocabulary axis is float32 (float64 for float64 inputs) whatever the input
dtype: bf16 hidden states are upcast before the temperature divides them, and a bf16 W is upcast
block by block into float32 matmuls, so no logit is rounded to bf16.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["token_entropy", "token_logprobs"]

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per chunk for `token_logprobs` / `token_entropy`: a C x V float32 temporary (0.6 GB at V=151936)."""


def check_labels(labels_K: Tensor, vocab_size: int) -> None:
    """Raise unless every label is a valid vocabulary index (an invalid one would read past the logits)."""
    if labels_K.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an int64 or int32 tensor, got {labels_K.dtype}")
    if labels_K.numel() == 0:
        return
    low, high = int(labels_K.min()), int(labels_K.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) (the vocabulary), got values in [{low}, {high}]: "
            "mask positions out with the loss mask instead of negative labels"
        )


def check_chunk_size(chunk_size: int) -> None:
    """Raise unless chunk_size is a positive int."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")


def chunks(num_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """[(start, end)] covering range(num_tokens) in pieces of chunk_size."""
    return [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64: the dtype of all vocabulary-axis arithmetic."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _TokenLogprobs(torch.autograd.Function):
    """log p(label) from logits; backward writes softmax - onehot chunk by chunk into the gradient."""

    @staticmethod
    def forward(ctx: Any, logits_K_V: Tensor, labels_K: Tensor, chunk_size: int) -> Tensor:
        """[K, V] logits, [K] labels -> [K] float32 log-probs."""
        n, dtype = logits_K_V.shape[0], compute_dtype(logits_K_V)
        lse_K = torch.empty(n, dtype=dtype, device=logits_K_V.device)
        out_K = torch.empty(n, dtype=dtype, device=logits_K_V.device)
        for s, e in chunks(n, chunk_size):
            chunk_C_V = logits_K_V[s:e].to(dtype)
            torch.logsumexp(chunk_C_V, dim=-1, out=lse_K[s:e])
            picked_C = chunk_C_V.gather(1, labels_K[s:e, None]).squeeze(1)
            out_K[s:e] = picked_C - lse_K[s:e]
        ctx.save_for_backward(logits_K_V, labels_K, lse_K)
        ctx.chunk_size = chunk_size
        return out_K

    @staticmethod
    def backward(ctx: Any, grad_K: Tensor) -> tuple[Tensor, None, None]:
        """d logprob / d logits = onehot(label) - softmax, scaled by the incoming gradient."""
        logits_K_V, labels_K, lse_K = ctx.saved_tensors
        grad_K_V = torch.empty_like(logits_K_V)
        in_place = logits_K_V.dtype == lse_K.dtype
        for s, e in chunks(logits_K_V.shape[0], ctx.chunk_size):
            g_C1 = grad_K[s:e, None].to(lse_K.dtype)
            if in_place:
                chunk_C_V = torch.sub(logits_K_V[s:e], lse_K[s:e, None], out=grad_K_V[s:e])
            else:
                chunk_C_V = logits_K_V[s:e].to(lse_K.dtype).sub_(lse_K[s:e, None])
            chunk_C_V.exp_().mul_(-g_C1).scatter_add_(1, labels_K[s:e, None], g_C1)
            if not in_place:
                grad_K_V[s:e] = chunk_C_V
        return grad_K_V, None, None


def token_logprobs(logits_B_T_V: Tensor, labels_B_T: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """[B, T, V] logits, [B, T] labels -> [B, T] float32 log p(label), chunked, exact gradients."""
    check_chunk_size(chunk_size)
    if logits_B_T_V.dim() != 3 or labels_B_T.shape != logits_B_T_V.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and labels [B, T], got {tuple(logits_B_T_V.shape)} and {tuple(labels_B_T.shape)}"
        )
    b, t, v = logits_B_T_V.shape
    check_labels(labels_B_T, v)
    out_K: Tensor = _TokenLogprobs.apply(logits_B_T_V.reshape(b * t, v), labels_B_T.reshape(b * t).long(), chunk_size)
    return out_K.view(b, t)


class _TokenEntropy(torch.autograd.Function):
    """Entropy of softmax(logits) per token; backward recomputes the softmax chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, logits_K_V: Tensor, chunk_size: int) -> Tensor:
        """[K, V] logits -> [K] float32 entropy."""
        n, dtype = logits_K_V.shape[0], compute_dtype(logits_K_V)
        lse_K = torch.empty(n, dtype=dtype, device=logits_K_V.device)
        entropy_K = torch.empty(n, dtype=dtype, device=logits_K_V.device)
        for s, e in chunks(n, chunk_size):
            shifted_C_V = logits_K_V[s:e].to(dtype)
            max_C1 = shifted_C_V.amax(dim=-1, keepdim=True)
            shifted_C_V = shifted_C_V - max_C1
            exp_C_V = shifted_C_V.exp()
            sum_C = exp_C_V.sum(dim=-1)
            weighted_C = shifted_C_V.mul_(exp_C_V).sum(dim=-1)
            # H = -sum p log p with log p = x - log(sum e^x), x = logits - max
            entropy_K[s:e] = sum_C.log() - weighted_C / sum_C
            lse_K[s:e] = max_C1.squeeze(1) + sum_C.log()
        ctx.save_for_backward(logits_K_V, lse_K, entropy_K)
        ctx.chunk_size = chunk_size
        return entropy_K

    @staticmethod
    def backward(ctx: Any, grad_K: Tensor) -> tuple[Tensor, None]:
        """d H / d logit_j = -p_j (log p_j + H), scaled by the incoming gradient."""
        logits_K_V, lse_K, entropy_K = ctx.saved_tensors
        grad_K_V = torch.empty_like(logits_K_V)
        for s, e in chunks(logits_K_V.shape[0], ctx.chunk_size):
            logp_C_V = logits_K_V[s:e].to(lse_K.dtype) - lse_K[s:e, None]
            p_C_V = logp_C_V.exp()
            logp_C_V.add_(entropy_K[s:e, None]).mul_(p_C_V).mul_(-grad_K[s:e, None].to(lse_K.dtype))
            grad_K_V[s:e] = logp_C_V
        return grad_K_V, None


def token_entropy(logits_B_T_V: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """[B, T, V] logits -> [B, T] float32 entropy of softmax(logits), chunked, with gradients."""
    check_chunk_size(chunk_size)
    if logits_B_T_V.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got {tuple(logits_B_T_V.shape)}")
    b, t, v = logits_B_T_V.shape
    entropy_K: Tensor = _TokenEntropy.apply(logits_B_T_V.reshape(b * t, v), chunk_size)
    return entropy_K.view(b, t)
