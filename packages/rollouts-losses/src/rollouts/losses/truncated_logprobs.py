"""Log-probabilities under the truncated distribution a top-k / top-p sampler draws from:
`truncation_mask` (the kept set) and the chunked, checkpointed path `fused_token_logprobs` takes
when top_k or top_p is set. Every row needs its whole vocabulary to rank, so this path chunks
tokens only (C x V blocks), unlike the vocabulary-blocked kernel in fused_kernel.py.

Legend: K flattened tokens, C tokens per chunk, V vocabulary, H hidden.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rollouts.losses.logprobs import chunks, compute_dtype

__all__ = ["truncated_chunk_size", "truncated_token_logprobs", "truncation_mask"]

_TRUNCATED_FRACTION_OF_LOGITS = 16
"""Default chunks hold C x V float32 logits within 1/16 of the K x V logits (the ranking adds a few more)."""
_MIN_TRUNCATED_CHUNK = 16
"""Below 16 rows a [C, H] @ [H, V] matmul loses much of its efficiency on CPU and GPU alike."""


def truncated_chunk_size(num_tokens: int, vocab_size: int, budget_bytes: int) -> int:
    """Tokens per chunk of the truncated path: 1/16 of K, within budget_bytes of C x V float32, at least 16."""
    by_fraction = -(-num_tokens // _TRUNCATED_FRACTION_OF_LOGITS)
    return max(_MIN_TRUNCATED_CHUNK, min(by_fraction, budget_bytes // (vocab_size * 4)))


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


def truncated_token_logprobs(
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
