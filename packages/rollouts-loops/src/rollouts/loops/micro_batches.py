"""One rank's share of a step, planned into micro-batches, with the step-wide counts the loss needs.

Shared by SFT and RL. Under torchrun each rank trains samples[rank::world]; the loss is normalised
by counts over every rank, and every rank runs as many forward passes as the busiest one (FSDP's
collectives must line up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rollouts.backends import TrainingComponents, packed_only
from rollouts.data import plan_micro_batches
from rollouts.loops.run.distributed import global_counts, rank_world, same_count_on_every_rank
from rollouts.types import MicroBatch, Sample

_PADDED_MIN_FILL = 0.9
"""Use the padded layout when padding would waste under 10% of the tokens: packing many short
sequences into one row costs attention over the whole row (block-diagonal mask), padding does not."""


def attention_pair_cost(config: object) -> float | None:
    """The multiply-adds of one query-key pair of attention over those of one token through a layer's
    projections and MLP, from a Llama-style config; None when the config lacks a size.

    Per pair: q.k and p.v over every query head (2 * heads * head_dim). Per token: the q, k, v and o
    projections and a gated MLP (3 * hidden * intermediate). The output layer is left out: it runs
    on the loss tokens only, the same number in either layout.
    """
    sizes = [getattr(config, name, None) for name in ("hidden_size", "intermediate_size", "num_attention_heads")]
    ints = [n for n in sizes if isinstance(n, int) and n > 0]
    if len(ints) != len(sizes):
        return None
    hidden, intermediate, num_heads = ints
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or hidden // num_heads
    if not isinstance(num_kv_heads, int) or not isinstance(head_dim, int) or head_dim < 1:
        return None
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    per_token = hidden * (2 * q_dim + 2 * kv_dim) + 3 * hidden * intermediate
    return 2 * q_dim / per_token


def choose_layout(
    samples: Sequence[Sample],
    *,
    packed_only: bool = False,
    pair_cost: float | None = None,
    max_tokens: int | None = None,
) -> Literal["packed", "padded"]:
    """'padded' for near-uniform lengths, else the cheaper layout by the arithmetic of both.

    `packed_only`: the model's attention takes no padding mask (flash kernels; see
    rollouts.backends.packed_only), so always 'packed'.
    `pair_cost` (`attention_pair_cost` of the model): with it, 'padded' also wins wherever its
    wasted tokens cost less than the attention a packed row spends across its sequences (a packed
    row of `max_tokens` at most attends over the whole row through a dense mask; a padded row of
    length T runs the causal kernel over T * T / 2 pairs). Many short sequences, as in RL
    completions of a small model, pad cheaper than they pack. Without it: 'packed'.
    """
    if packed_only:
        return "packed"
    lengths = [len(s.tokens) for s in samples]
    if not lengths:
        return "padded"
    longest, total = max(lengths), sum(lengths)
    if total >= _PADDED_MIN_FILL * longest * len(lengths):
        return "padded"
    if pair_cost is None:
        return "packed"
    row = total if max_tokens is None else min(total, max_tokens)
    padded = len(lengths) * longest * (1.0 + pair_cost * longest / 2)
    packed = total * (1.0 + pair_cost * row)
    return "padded" if padded <= packed else "packed"


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
    model = components.model
    layout = choose_layout(
        local,
        packed_only=packed_only(model),
        pair_cost=attention_pair_cost(getattr(model, "config", None)),
        max_tokens=max_tokens_per_micro_batch,
    )
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
