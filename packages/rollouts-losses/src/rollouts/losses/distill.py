"""Distillation divergences between a student's and a teacher's next-token distributions, over the
whole vocabulary at each position (knowledge distillation; GKD's generalized Jensen-Shannon divergence).

Legend: K positions, V vocabulary, H student hidden size, G teacher hidden size, C positions per chunk.

`beta` picks the divergence, as in GKD (Agarwal et al. 2024) and TRL's `GKDTrainer`: with p the
student's distribution and q the teacher's,

    beta = 1:      KL(p || q) = sum_v p (log p - log q)         reverse KL, mode-seeking
    beta = 0:      KL(q || p) = sum_v q (log q - log p)         forward KL, mass-covering
    0 < beta < 1:  beta KL(q || m) + (1 - beta) KL(p || m),  m = beta q + (1 - beta) p

The end points are the KLs themselves, not the limits of the mixture form (which shrink toward 0
near either end). The student's logits are divided by `temperature` (its sampling temperature: the
distribution it draws from); the teacher's are taken as they are. All vocabulary-axis arithmetic is
float32 (float64 for float64 inputs). Only the student receives gradients.

`distill_divergence` takes logits; `fused_distill_divergence` takes final hidden states and output
projections and never holds more than one chunk's [C, V] logits: each chunk is recomputed in
backward (checkpointed).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rollouts.losses.logprobs import check_chunk_size, chunks, compute_dtype

__all__ = ["check_beta", "distill_divergence", "fused_distill_divergence"]

_CHUNK_ELEMENTS = 1 << 24
"""Default chunk: C x V at most this many logits per side (64 MB of float32), C >= 1."""


def check_beta(beta: float) -> float:
    """`beta` as a float, or ValueError unless it is a number in [0, 1]."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"beta must be a number in [0, 1] (1: reverse KL, 0: forward KL, between: generalized JSD), got {beta!r}"
        )
    return float(beta)


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if not math.isfinite(temperature):
        raise ValueError(f"temperature must be finite, got {temperature!r}")
    return float(temperature)


def _divergence(student_logp_C_V: Tensor, teacher_logp_C_V: Tensor, beta: float) -> Tensor:
    """[C] divergence between two rows of log-probabilities (see the module's docstring)."""
    p, q = student_logp_C_V, teacher_logp_C_V
    if beta == 1.0:
        return (p.exp() * (p - q)).sum(-1)
    if beta == 0.0:
        return (q.exp() * (q - p)).sum(-1)
    m = torch.logaddexp(p + math.log1p(-beta), q + math.log(beta))
    return beta * (q.exp() * (q - m)).sum(-1) + (1.0 - beta) * (p.exp() * (p - m)).sum(-1)


def distill_divergence(
    student_logits: Tensor, teacher_logits: Tensor, *, beta: float = 1.0, temperature: float = 1.0
) -> Tensor:
    """[..., V] student and teacher logits -> [...] divergence per position (differentiable in the student's).

    The teacher's logits are detached. Both must have the same shape: the same vocabulary.
    """
    beta, temperature = check_beta(beta), _check_temperature(temperature)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits must have one shape (one vocabulary), got {tuple(student_logits.shape)} "
            f"and {tuple(teacher_logits.shape)}"
        )
    dtype = compute_dtype(student_logits, teacher_logits)
    p = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    q = torch.log_softmax(teacher_logits.detach().to(dtype), dim=-1)
    return _divergence(p, q, beta)


def _chunk(
    student_C_H: Tensor, student_V_H: Tensor, teacher_C_G: Tensor, teacher_V_G: Tensor, beta: float, temperature: float
) -> Tensor:
    dtype = compute_dtype(student_C_H, student_V_H, teacher_C_G, teacher_V_G)
    p = torch.log_softmax((student_C_H.to(dtype) @ student_V_H.to(dtype).T) / temperature, dim=-1)
    with torch.no_grad():
        q = torch.log_softmax(teacher_C_G.to(dtype) @ teacher_V_G.to(dtype).T, dim=-1)
    return _divergence(p, q, beta)


def fused_distill_divergence(
    student_hidden: Tensor,
    student_weight_V_H: Tensor,
    teacher_hidden: Tensor,
    teacher_weight_V_G: Tensor,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    """[..., H] student hidden states, [V, H] its output projection, [..., G] the teacher's at the
    same positions, [V, G] its output projection -> [...] divergence per position.

    Equal to `distill_divergence(student_hidden @ W_s.T, teacher_hidden @ W_t.T)` up to float
    rounding, with gradients to the student's hidden states and projection only; the logits are
    never whole: `chunk_size` positions at a time (default: about 16M logits per chunk).
    """
    beta, temperature = check_beta(beta), _check_temperature(temperature)
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    lead = student_hidden.shape[:-1]
    if teacher_hidden.shape[:-1] != lead:
        raise ValueError(
            f"the student's and the teacher's hidden states must cover the same positions, got "
            f"{tuple(student_hidden.shape)} and {tuple(teacher_hidden.shape)}"
        )
    for name, hidden, weight in (
        ("student", student_hidden, student_weight_V_H),
        ("teacher", teacher_hidden, teacher_weight_V_G),
    ):
        if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
            raise ValueError(
                f"the {name}'s output projection must be [V, {hidden.shape[-1]}] (its hidden size), "
                f"got {tuple(weight.shape)}"
            )
    if student_weight_V_H.shape[0] != teacher_weight_V_G.shape[0]:
        raise ValueError(
            f"the student's vocabulary has {student_weight_V_H.shape[0]} rows and the teacher's "
            f"{teacher_weight_V_G.shape[0]}: a divergence compares distributions over one vocabulary"
        )
    student_K_H = student_hidden.reshape(-1, student_hidden.shape[-1])
    teacher_K_G = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    teacher_V_G = teacher_weight_V_G.detach()
    size = chunk_size or max(1, _CHUNK_ELEMENTS // max(1, student_weight_V_H.shape[0]))
    parts = [
        checkpoint(
            _chunk,
            student_K_H[s:e],
            student_weight_V_H,
            teacher_K_G[s:e],
            teacher_V_G,
            beta,
            temperature,
            use_reentrant=False,
        )
        for s, e in chunks(student_K_H.shape[0], size)
    ]
    if not parts:  # no positions: still a function of the student's inputs, so backward reaches them
        return (student_K_H.sum() * 0.0).expand(0).reshape(lead).to(compute_dtype(student_hidden, teacher_hidden))
    return torch.cat(parts).reshape(lead)
