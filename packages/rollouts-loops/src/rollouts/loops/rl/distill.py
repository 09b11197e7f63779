"""On-policy distillation: the student (the policy) samples and a teacher scores its samples, in
one of two ways (`Distillation.estimate`):

- "sampled": each sampled token's advantage is coef * (teacher log-prob - student log-prob), the
  negative of the per-token estimate of the reverse KL, KL(student || teacher), on the student's own
  samples (the Thinking Machines / Tinker recipe). A token's advantage is its own KL term only, with
  no sum over the tokens after it (discount 0), as in that recipe. Any teacher: one in this process
  or a server's prompt log-probs.
- "full": at each sampled position the divergence between the student's and the teacher's whole
  next-token distributions joins the loss, coef * its token-mean (TRL's GKD at lambda = 1;
  `beta` 1 is the reverse KL itself, 0 the forward KL, between GKD's generalized JSD; see
  rollouts.losses.distill). Exact where "sampled" estimates from one token, so it learns from
  far fewer samples; it needs the teacher's whole distributions, so a teacher in this process.

Either replaces the task reward's advantage (`mode = "replace"`: no reward needed; with "full" the
advantages are zero and the divergence alone trains) or is added to it (`"add"`).

Log-probs on both sides: the student's of the distribution sampled from (temperature, top-k and
top-p, as the loss uses), the teacher's of its own distribution (temperature 1, no truncation,
as vLLM's prompt log-probs are).

A teacher is either an HF model in the trainer's process (`TrainingComponents`, frozen like the
KL reference, its log-probs computed over the same micro-batches; under torchrun it is given on
every rank, sharded like the reference), or a server that scores token sequences
(`EngineTeacher`, vLLM's `prompt_logprobs`; each rank sends its own samples).

Legend: N samples in the step, T_i tokens of sample i.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import trio

from rollouts.backends import DistillTerm, TrainingComponents, compute_logprobs
from rollouts.data import unpack_values
from rollouts.loops.micro_batches import ShardPlan
from rollouts.loops.rollouts.functions import model_vocab_size
from rollouts.loops.run.distributed import global_sum, rank_world
from rollouts.losses import check_beta
from rollouts.sync import PromptLogprobsClient
from rollouts.types import MicroBatch

__all__ = ["Distillation", "EngineTeacher", "SequenceScorer", "check_teacher", "distill_advantages"]

REVERSE_KL_METRIC = "distill/reverse_kl"


@runtime_checkable
class SequenceScorer(Protocol):
    """A teacher outside the trainer: [T_i] log-probs per token-id sequence (entry t: log p(token t |
    tokens < t); entry 0 is not read), called from the trainer's thread (it blocks)."""

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]: ...


class EngineTeacher:
    """A teacher served by vLLM: each call opens its own connections in an event loop of its own
    (the trainer calls it from worker threads, outside the run's loop), bounded and retried by
    rollouts.sync.PromptLogprobsClient. `vocab_size`: the served model's, for the vocabulary check
    (None: not checked)."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        max_batch: int = 64,
        vocab_size: int | None = None,
    ) -> None:
        self.options: dict[str, Any] = dict(
            model=model, api_key=api_key, timeout_s=timeout_s, max_retries=max_retries, max_batch=max_batch
        )
        PromptLogprobsClient(url, **self.options)  # bad options fail here, not at the first step
        self.url = url
        self.vocab_size = vocab_size

    def __repr__(self) -> str:
        return f"EngineTeacher({self.url!r}, vocab_size={self.vocab_size})"

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        async def ask() -> list[list[float]]:
            async with PromptLogprobsClient(self.url, **self.options) as client:
                return await client.sequence_logprobs(sequences)

        return [np.asarray(row, dtype=np.float32) for row in trio.run(ask)]


Teacher = TrainingComponents | SequenceScorer


@dataclass(frozen=True, slots=True, kw_only=True)
class Distillation:
    """A teacher and how its per-token advantage enters the step."""

    teacher: Teacher
    """An HF causal LM in this process (TrainingComponents; its optimizer is never stepped) or a
    SequenceScorer (EngineTeacher). Its vocabulary must be the student's."""
    coef: float = 1.0
    """Scale of teacher log-prob - student log-prob in the advantage."""
    mode: Literal["replace", "add"] = "replace"
    """"replace": the advantage is the distillation term alone; "add": added to the task reward's."""
    estimate: Literal["sampled", "full"] = "sampled"
    """"sampled": the sampled token's log-prob gap as its advantage; "full": the divergence over the
    whole vocabulary at each position as a loss term (a teacher in this process only)."""
    beta: float = 1.0
    """"full" only: the divergence (1 reverse KL, 0 forward KL, between generalized JSD)."""

    def __post_init__(self) -> None:
        if not isinstance(self.teacher, (TrainingComponents, SequenceScorer)):
            raise TypeError(
                "Distillation.teacher must be TrainingComponents (an HF model in this process) or have "
                f"sequence_logprobs(sequences) (EngineTeacher), got {type(self.teacher).__name__}"
            )
        if isinstance(self.coef, bool) or not isinstance(self.coef, (int, float)) or not math.isfinite(self.coef):
            raise ValueError(f"Distillation.coef must be a finite number, got {self.coef!r}")
        if self.coef <= 0:
            raise ValueError(
                f"Distillation.coef must be > 0 (it scales a KL the student should shrink), got {self.coef}"
            )
        if self.mode not in ("replace", "add"):
            raise ValueError(f"Distillation.mode must be 'replace' or 'add', got {self.mode!r}")
        if self.estimate not in ("sampled", "full"):
            raise ValueError(f"Distillation.estimate must be 'sampled' or 'full', got {self.estimate!r}")
        try:
            check_beta(self.beta)
        except ValueError as e:
            raise ValueError(f"Distillation.{e}") from None
        if self.estimate == "sampled" and self.beta != 1.0:
            raise ValueError(
                f"Distillation.beta={self.beta} needs estimate='full': a sampled token estimates the reverse KL only"
            )
        if self.estimate == "full" and not isinstance(self.teacher, TrainingComponents):
            raise ValueError(
                "Distillation.estimate='full' needs the teacher's whole next-token distributions, so a teacher "
                f"in this process (TrainingComponents), got {type(self.teacher).__name__}: a server's prompt "
                "log-probs give the sampled tokens' only (estimate='sampled')"
            )

    def term(self) -> DistillTerm | None:
        """forward_backward's loss term with estimate='full' (None with 'sampled')."""
        if self.estimate != "full":
            return None
        assert isinstance(self.teacher, TrainingComponents)
        return DistillTerm(teacher=self.teacher, coef=self.coef, beta=self.beta)


def teacher_vocab_size(teacher: Teacher) -> int | None:
    """The teacher's vocabulary size (None: unknown)."""
    if isinstance(teacher, TrainingComponents):
        return model_vocab_size(teacher.model)
    size = getattr(teacher, "vocab_size", None)
    return int(size) if size is not None else None


def check_teacher(distill: Distillation, student: Any) -> None:
    """Refuse, before any work, a teacher whose vocabulary is not the student model's: its log-probs
    would score other tokens than those sampled."""
    theirs, ours = teacher_vocab_size(distill.teacher), model_vocab_size(student)
    if theirs is not None and ours is not None and theirs != ours:
        raise ValueError(
            f"the distillation teacher's vocabulary has {theirs} tokens and the student's {ours}: a teacher "
            "scores the student's token ids, so both must use the same tokenizer and vocabulary size"
        )


def _teacher_logprobs(
    teacher: Teacher, micro_batches: Sequence[MicroBatch[np.ndarray]], num_real: int
) -> dict[int, np.ndarray]:
    """This rank's sample index -> [T_i] teacher log-probs of its tokens."""
    real = micro_batches[:num_real]
    if isinstance(teacher, TrainingComponents):
        # every micro-batch, fillers included: a sharded teacher runs as many forwards on each rank
        return unpack_values(real, compute_logprobs(teacher, micro_batches)[:num_real])
    ids = unpack_values(real, [mb.input_ids for mb in real])
    order = sorted(ids)
    rows = teacher.sequence_logprobs([ids[i].tolist() for i in order])
    if len(rows) != len(order):
        raise ValueError(f"the teacher returned {len(rows)} rows of log-probs for {len(order)} sequences")
    out = {}
    for i, row in zip(order, rows, strict=True):
        if row.shape != ids[i].shape:
            raise ValueError(f"the teacher returned {row.shape[0]} log-probs for a sequence of {len(ids[i])} tokens")
        out[i] = row
    return out


def distill_advantages(
    distill: Distillation,
    advantages: Mapping[int, np.ndarray],
    *,
    shard: ShardPlan,
    micro_batches: Sequence[MicroBatch[np.ndarray]],
    student: Sequence[np.ndarray],
    masks: Mapping[int, np.ndarray],
) -> tuple[dict[int, np.ndarray], dict[str, float]]:
    """(advantages with this rank's samples' distillation term, {distill/reverse_kl}).

    `advantages`: global sample index -> [T_i] (the task's); `student`: [B, T_row] log-probs per
    micro-batch of this rank (the sampling distribution's); `masks`: this rank's sample index -> [T_i]
    loss mask. The metric is the step's token-mean of student - teacher log-prob over every rank.
    """
    rank, world = rank_world()
    teacher = _teacher_logprobs(distill.teacher, micro_batches, shard.num_real)
    mine = unpack_values(micro_batches[: shard.num_real], list(student[: shard.num_real]))
    out = dict(advantages)
    kl_sum = 0.0
    for i in range(len(shard.local)):
        gap = np.where(masks[i] > 0, teacher[i] - mine[i], 0.0).astype(np.float32)
        kl_sum -= float(gap.sum())
        index = rank + i * world
        out[index] = distill.coef * gap + (out[index] if distill.mode == "add" else 0.0)
    return out, {REVERSE_KL_METRIC: global_sum(kl_sum) / max(1, shard.num_tokens)}
