"""Log-probabilities and entropy straight from hidden states and the output projection, never holding
the logits: `fused_token_logprobs` (and the truncated distribution of a top-k / top-p sampler,
`truncation_mask`). The legend and the float32 rule are those of logprobs.py.

Legend: K flattened tokens, C tokens per chunk, V vocabulary, H hidden.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rollouts.losses.logprobs import check_chunk_size, check_labels, chunks, compute_dtype

__all__ = ["fused_chunk_size", "fused_token_logprobs", "truncation_mask"]


_WEIGHT_BLOCK_BYTES = 32 * 2**20
"""Bytes of one float32 copy of a vocabulary block of W, made when W is stored in lower precision
(bf16/fp16): the matmul then runs in float32 on exact upcasts, so nothing is rounded to bf16 on
the way to the logits, while the copy stays small and independent of V."""


def _vocab_blocks(weight_V_H: Tensor, dtype: torch.dtype) -> list[tuple[int, int]]:
    """[(start, end)] over W's rows in blocks whose copy in dtype takes at most _WEIGHT_BLOCK_BYTES."""
    v, h = weight_V_H.shape
    return chunks(v, max(1, _WEIGHT_BLOCK_BYTES // (h * torch.finfo(dtype).bits // 8)))


def _chunk_logits(h_C_H: Tensor, weight_V_H: Tensor, out_C_V: Tensor) -> Tensor:
    """[C, H] (dtype) @ [V, H].T -> [C, V] logits written into out_C_V (dtype), float32 accumulation.

    A W stored in bf16 is upcast block by block (exactly), so the logits are never rounded to bf16.
    """
    dtype = out_C_V.dtype
    if weight_V_H.dtype == dtype:
        return torch.mm(h_C_H, weight_V_H.t(), out=out_C_V)
    for s, e in _vocab_blocks(weight_V_H, dtype):
        out_C_V[:, s:e] = torch.mm(h_C_H, weight_V_H[s:e].to(dtype).t())
    return out_C_V


def _chunk_grad_hidden(p_C_V: Tensor, weight_V_H: Tensor, out_C_H: Tensor) -> Tensor:
    """[C, V] @ [V, H] -> [C, H] written into out_C_H, in out_C_H's dtype (W upcast block by block)."""
    if weight_V_H.dtype == out_C_H.dtype:
        return torch.mm(p_C_V, weight_V_H, out=out_C_H)
    out_C_H.zero_()
    for s, e in _vocab_blocks(weight_V_H, out_C_H.dtype):
        out_C_H.addmm_(p_C_V[:, s:e], weight_V_H[s:e].to(out_C_H.dtype))
    return out_C_H


def _scaled(hidden_C_H: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """hidden / temperature in dtype: upcast first, so a bf16 input is divided in float32."""
    h_C_H = hidden_C_H.to(dtype)
    return h_C_H / temperature if temperature != 1.0 else h_C_H


FUSED_MEMORY_BUDGET_BYTES = 512 * 2**20
"""Upper bound on the C x V float32 buffers of `fused_token_logprobs` when chunk_size is chosen for you."""
_FUSED_FRACTION_OF_LOGITS = 16
"""Adaptive chunks keep the C x V buffers within 1/16 of one K x V float32 logits tensor: the naive
log_softmax(h @ W.T).gather holds at least that tensor and its log-softmax (>= 2 of them) through
backward, so the buffers stay below 1/32 of naive and the rest (the [K, H] gradient) has room
under the 1/8 goal."""
_MIN_FUSED_CHUNK = 16
"""Below 16 rows a [C, H] @ [H, V] matmul loses much of its efficiency on CPU and GPU alike."""


def fused_chunk_size(
    num_tokens: int, vocab_size: int, *, with_entropy: bool = False, budget_bytes: int = FUSED_MEMORY_BUDGET_BYTES
) -> int:
    """Tokens per chunk for `fused_token_logprobs`: grows with K (so the matmuls stay large) but keeps the
    C x V float32 buffers (two with entropy) within 1/16 of the K x V logits and within budget_bytes."""
    if num_tokens < 0 or vocab_size < 1 or budget_bytes < 1:
        raise ValueError(
            f"need num_tokens >= 0, vocab_size >= 1, budget_bytes >= 1, got {num_tokens}, {vocab_size}, {budget_bytes}"
        )
    num_buffers = 2 if with_entropy else 1
    by_fraction = -(-num_tokens // (_FUSED_FRACTION_OF_LOGITS * num_buffers))
    by_budget = budget_bytes // (num_buffers * vocab_size * 4)
    return max(_MIN_FUSED_CHUNK, min(by_fraction, by_budget))


class _FusedTokenLogprobs(torch.autograd.Function):
    """log p(label) (and entropy) from hidden states and the output projection, chunk by chunk.

    Saves only the [K] log-sum-exp (and entropy); backward recomputes each chunk's logits, turns
    them in place into probabilities p, and spends one matmul each on G @ W and G.T @ h where
    G = g (onehot - p): the per-token scale -g is applied to the small [C, H] operands and the
    onehot part is a gather / index_add of H-vectors, so the C x V buffer is touched only by exp.
    The temperature divides the float32 upcast of each hidden chunk, never a bf16 tensor.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_K_H: Tensor,
        weight_V_H: Tensor,
        labels_K: Tensor,
        chunk_size: int,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        """[K, H] hidden, [V, H] weight, [K] labels -> ([K] log-probs, [K] entropy or empty)."""
        ctx.set_materialize_grads(False)
        n, device = hidden_K_H.shape[0], hidden_K_H.device
        dtype = compute_dtype(hidden_K_H, weight_V_H)
        c = min(chunk_size, max(n, 1))
        buf_C_V = torch.empty(c, weight_V_H.shape[0], dtype=dtype, device=device)
        aux_C_V = torch.empty_like(buf_C_V) if with_entropy else None
        lse_K = torch.empty(n, dtype=dtype, device=device)
        logprobs_K = torch.empty(n, dtype=dtype, device=device)
        entropy_K = torch.empty(n if with_entropy else 0, dtype=dtype, device=device)
        for s, e in chunks(n, chunk_size):
            x_C_V = _chunk_logits(_scaled(hidden_K_H[s:e], temperature, dtype), weight_V_H, buf_C_V[: e - s])
            max_C1 = x_C_V.amax(dim=-1, keepdim=True)
            picked_C = x_C_V.gather(1, labels_K[s:e, None]).squeeze(1)
            x_C_V.sub_(max_C1)
            if aux_C_V is not None:
                exp_C_V = torch.exp(x_C_V, out=aux_C_V[: e - s])
                sum_C = exp_C_V.sum(dim=-1)
                weighted_C = x_C_V.mul_(exp_C_V).sum(dim=-1)
                entropy_K[s:e] = sum_C.log() - weighted_C / sum_C
            else:
                sum_C = x_C_V.exp_().sum(dim=-1)
            lse_K[s:e] = max_C1.squeeze(1) + sum_C.log()
            logprobs_K[s:e] = picked_C - lse_K[s:e]
        ctx.save_for_backward(hidden_K_H, weight_V_H, labels_K, lse_K, entropy_K)
        ctx.chunk_size, ctx.temperature, ctx.with_entropy = chunk_size, temperature, with_entropy
        return logprobs_K, entropy_K

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs_K: Tensor | None, grad_entropy_K: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        """Recompute logits per chunk; G = g (onehot - p) - g_H p (log p + H); dh = G W / temp; dW = G.T h / temp."""
        hidden_K_H, weight_V_H, labels_K, lse_K, entropy_K = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_entropy = ctx.with_entropy and grad_entropy_K is not None
        if (grad_logprobs_K is None and not use_entropy) or not (need_h or need_w):
            return None, None, None, None, None, None
        n, device, temperature = hidden_K_H.shape[0], hidden_K_H.device, ctx.temperature
        dtype = compute_dtype(hidden_K_H, weight_V_H)
        c = min(ctx.chunk_size, max(n, 1))
        buf_C_V = torch.empty(c, weight_V_H.shape[0], dtype=dtype, device=device)
        aux_C_V = torch.empty_like(buf_C_V) if use_entropy else None
        grad_h_K_H = torch.empty(n, hidden_K_H.shape[1], dtype=dtype, device=device) if need_h else None
        # float32 accumulator across chunks even for a bf16 W: summing the chunks in bf16 would lose the small ones
        grad_w_V_H = torch.zeros(weight_V_H.shape, dtype=dtype, device=device) if need_w else None
        g_K = grad_logprobs_K.to(dtype) if grad_logprobs_K is not None else torch.zeros(n, dtype=dtype, device=device)
        for s, e in chunks(n, ctx.chunk_size):
            h_C_H = _scaled(hidden_K_H[s:e], temperature, dtype)
            g_C1 = g_K[s:e, None]
            labels_C = labels_K[s:e]
            x_C_V = _chunk_logits(h_C_H, weight_V_H, buf_C_V[: e - s]).sub_(lse_K[s:e, None])  # log p
            if aux_C_V is not None:
                p_C_V = torch.exp(x_C_V, out=aux_C_V[: e - s])
                assert grad_entropy_K is not None  # use_entropy
                g_h_C1 = grad_entropy_K[s:e, None].to(dtype)
                # G = -p * (g + g_H (log p + H)); the label's +g is added below
                x_C_V.add_(entropy_K[s:e, None]).mul_(g_h_C1).add_(g_C1).mul_(p_C_V)
            else:
                x_C_V.exp_()  # p; G = -g p + g onehot, and the row scale -g moves into the matmuls below
            row_scale_C1 = -g_C1 if aux_C_V is None else torch.full_like(g_C1, -1.0)
            if grad_h_K_H is not None:
                # G @ W = row_scale * (x @ W) + g * W[label]
                grad_h_C_H = _chunk_grad_hidden(x_C_V, weight_V_H, grad_h_K_H[s:e])
                grad_h_C_H.mul_(row_scale_C1).add_(weight_V_H[labels_C].to(dtype) * g_C1)
            if grad_w_V_H is not None:
                # G.T @ h = x.T @ (row_scale * h) + g h scattered onto the label rows
                grad_w_V_H.addmm_(x_C_V.t(), h_C_H * row_scale_C1)
                grad_w_V_H.index_add_(0, labels_C, h_C_H * g_C1)
        if grad_h_K_H is not None:
            if temperature != 1.0:
                grad_h_K_H.div_(temperature)
            grad_h_K_H = grad_h_K_H.to(hidden_K_H.dtype)
        if grad_w_V_H is not None:
            grad_w_V_H = grad_w_V_H.to(weight_V_H.dtype)
        return grad_h_K_H, grad_w_V_H, None, None, None, None


def truncation_mask(logits_K_V: Tensor, *, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """[K, V] bool: the tokens a sampler with top-k and then top-p keeps, from temperature-scaled logits.

    top-k keeps every logit >= the k-th largest (ties kept); top-p then drops a token once the
    tokens ranked above it hold `top_p` of the top-k distribution's mass (the most likely token
    always stays). The in-process sampler draws from exactly this set, and the trainer's
    log-probs renormalise over it (vLLM's sampler applies the same two steps in this order).
    """
    keep = torch.ones_like(logits_K_V, dtype=torch.bool)
    v = logits_K_V.shape[-1]
    if 0 < top_k < v:
        kth = logits_K_V.topk(top_k, dim=-1).values[:, -1:]
        keep = logits_K_V >= kth
    if top_p < 1.0:
        masked = logits_K_V.masked_fill(~keep, -torch.inf)
        sorted_K_V, order = masked.sort(dim=-1, descending=True)
        probs = sorted_K_V.softmax(dim=-1)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        keep = keep & ~torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return keep


def _truncated_chunk(
    h_C_H: Tensor, weight_V_H: Tensor, labels_C: Tensor, temperature: float, top_k: int, top_p: float
) -> Tensor:
    dtype = compute_dtype(h_C_H, weight_V_H)
    logits = (h_C_H.to(dtype) / temperature) @ weight_V_H.to(dtype).t()
    with torch.no_grad():
        keep = truncation_mask(logits, top_k=top_k, top_p=top_p)
        # The sampled token is in the set by construction; where float rounding puts it on the other
        # side of a boundary, keep it (a log-prob of -inf would poison the loss).
        keep.scatter_(1, labels_C[:, None], True)
    logprobs = torch.log_softmax(logits.masked_fill(~keep, -torch.inf), dim=-1)
    return logprobs.gather(1, labels_C[:, None]).squeeze(1)


def _truncated_token_logprobs(
    hidden_K_H: Tensor,
    weight_V_H: Tensor,
    labels_K: Tensor,
    chunk_size: int,
    temperature: float,
    top_k: int,
    top_p: float,
) -> Tensor:
    """[K] log-probs under the truncated, renormalised distribution, chunk by chunk; each chunk's
    logits are recomputed in backward (checkpointed), so memory stays at one chunk's."""
    from torch.utils.checkpoint import checkpoint

    out = []
    for s, e in chunks(hidden_K_H.shape[0], chunk_size):
        out.append(
            checkpoint(
                _truncated_chunk,
                hidden_K_H[s:e],
                weight_V_H,
                labels_K[s:e],
                temperature,
                top_k,
                top_p,
                use_reentrant=False,
            )
        )
    return torch.cat(out) if out else hidden_K_H.new_zeros(0, dtype=compute_dtype(hidden_K_H, weight_V_H))


def fused_token_logprobs(
    hidden_B_T_H: Tensor,
    lm_head_weight_V_H: Tensor,
    labels_B_T: Tensor,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    top_k: int = -1,
    top_p: float = 1.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """[B, T, H] hidden, [V, H] output projection, [B, T] labels -> [B, T] log p(label) of softmax(h W.T / temperature).

    With return_entropy, returns ([B, T] log-probs, [B, T] entropy), both differentiable. The
    B x T x V logits are never materialized, in forward or backward. chunk_size None (the default)
    picks `fused_chunk_size(B * T, V)`, which bounds the extra memory by a fraction of naive's at
    every size; the result does not depend on it beyond float rounding.

    `top_k` (> 0) / `top_p` (< 1): the log-probs of the distribution a sampler with those settings
    draws from (`truncation_mask`, renormalised), so importance ratios and KL compare the policy
    that was sampled; each chunk is then recomputed in backward (checkpointed). Not with
    return_entropy.
    """
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    if hidden_B_T_H.dim() != 3 or lm_head_weight_V_H.dim() != 2 or labels_B_T.shape != hidden_B_T_H.shape[:2]:
        raise ValueError(
            f"hidden must be [B, T, H], lm_head_weight [V, H] and labels [B, T], got {tuple(hidden_B_T_H.shape)}, "
            f"{tuple(lm_head_weight_V_H.shape)} and {tuple(labels_B_T.shape)}"
        )
    if hidden_B_T_H.shape[2] != lm_head_weight_V_H.shape[1]:
        raise ValueError(
            f"hidden size {hidden_B_T_H.shape[2]} does not match lm_head_weight [V, H] = {tuple(lm_head_weight_V_H.shape)}"
        )
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be > 0 (it divides the logits), got {temperature!r}")
    b, t, h = hidden_B_T_H.shape
    check_labels(labels_B_T, lm_head_weight_V_H.shape[0])
    if chunk_size is None:
        chunk_size = fused_chunk_size(b * t, lm_head_weight_V_H.shape[0], with_entropy=return_entropy)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not (top_k == -1 or top_k >= 1):
        raise ValueError(f"top_k must be -1 (off) or an int >= 1, got {top_k!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if 0 < top_k < lm_head_weight_V_H.shape[0] or top_p < 1.0:
        if return_entropy:
            raise ValueError("return_entropy is not supported with top_k / top_p truncation")
        logprobs_K = _truncated_token_logprobs(
            hidden_B_T_H.reshape(b * t, h),
            lm_head_weight_V_H,
            labels_B_T.reshape(b * t).long(),
            chunk_size,
            float(temperature),
            top_k,
            float(top_p),
        )
        return logprobs_K.view(b, t)
    fused: tuple[Tensor, Tensor] = _FusedTokenLogprobs.apply(
        hidden_B_T_H.reshape(b * t, h),
        lm_head_weight_V_H,
        labels_B_T.reshape(b * t).long(),
        chunk_size,
        float(temperature),
        return_entropy,
    )
    logprobs_K, entropy_K = fused
    if return_entropy:
        return logprobs_K.view(b, t), entropy_K.view(b, t)
    return logprobs_K.view(b, t)
