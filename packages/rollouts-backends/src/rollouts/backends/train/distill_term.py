"""A loss term from a frozen teacher in the trainer's process: the divergence between the model's
next-token distribution and the teacher's, over the whole vocabulary, at every loss token
(`forward_backward(..., distill=DistillTerm(...))`).

Legend: K kept (loss) positions, V vocabulary, H / G the model's / the teacher's hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from rollouts.backends.train.components import TrainingComponents
from rollouts.backends.train.hidden import kept_hidden
from rollouts.backends.train.inputs import HostLayout, micro_batch_to_torch
from rollouts.losses import check_beta, fused_distill_divergence
from rollouts.types import MicroBatch

__all__ = ["DISTILL_DIVERGENCE_METRIC", "DistillTerm", "distill_term"]

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


def distill_term(
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
            teacher_1_K_G, teacher_V_G, _ = kept_hidden(teacher, on_teacher, layout)
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
