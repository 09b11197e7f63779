"""One rank's share of a step, planned into micro-batches, with the step-wide counts the loss needs.

Shared by SFT and RL. Under torchrun each rank trains samples[rank::world]; the loss is normalised
by counts over every rank, and every rank runs as many forward passes as the busiest one (FSDP's
collectives must line up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollouts.backends import TrainingComponents, packed_only
from rollouts.data import plan_micro_batches
from rollouts.loops.distributed import global_counts, rank_world, same_count_on_every_rank
from rollouts.types import MicroBatch, Sample

_PADDED_MIN_FILL = 0.9
"""Use the padded layout when padding would waste under 10% of the tokens: packing many short
sequences into one row costs attention over the whole row (block-diagonal mask), padding does not."""


def choose_layout(samples: Sequence[Sample], *, packed_only: bool = False) -> str:
    """'padded' for near-uniform lengths, else 'packed' (minimal padding for long-tailed lengths).

    `packed_only`: the model's attention takes no padding mask (flash kernels; see
    rollouts.backends.packed_only), so always 'packed'.
    """
    if packed_only:
        return "packed"
    lengths = [len(s.tokens) for s in samples]
    fill = sum(lengths) / (max(lengths) * len(lengths)) if lengths else 1.0
    return "padded" if fill >= _PADDED_MIN_FILL else "packed"


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """This rank's micro-batches for one step and the step-wide loss denominators."""

    local: tuple[Sample, ...]
    """This rank's samples: the step's samples[rank::world]."""
    micro_batches: tuple[MicroBatch[np.ndarray], ...]
    """The planned micro-batches, then zero-loss fillers up to the busiest rank's count."""
    num_real: int
    """How many of `micro_batches` hold this rank's samples (the rest are fillers)."""
    num_tokens: int
    """Loss tokens of the whole step, over every rank."""
    num_sequences: int
    """Sequences of the whole step, over every rank."""


def plan_shard(
    components: TrainingComponents, samples: Sequence[Sample], *, max_tokens_per_micro_batch: int, what: str = "batch"
) -> ShardPlan:
    """Plan this rank's share of `samples` (one process: all of them)."""
    rank, world = rank_world()
    if len(samples) < world:
        raise ValueError(f"{what} of {len(samples)} samples cannot give each of {world} ranks one")
    local = tuple(samples[rank::world])
    layout = choose_layout(local, packed_only=packed_only(components.model))
    plan = plan_micro_batches(local, max_tokens=max_tokens_per_micro_batch, layout=layout)
    real = list(plan.micro_batches)
    num_tokens, num_sequences = global_counts(plan.num_loss_tokens, plan.num_sequences)
    return ShardPlan(
        local=local,
        micro_batches=tuple(same_count_on_every_rank(real)),
        num_real=len(real),
        num_tokens=num_tokens,
        num_sequences=num_sequences,
    )
