"""A step's preference pairs as micro-batches that keep each pair together, the per-sequence log-probs
read from them, and the loss function a trainer calls on them.

Sample index convention: in a step of P pairs, pair k's chosen sequence is sample 2k and its rejected
one 2k + 1 (`MicroBatch.sample_indices`), so a micro-batch names its pairs and the step's reference
log-probs are one [2P] array indexed the same way.

Legend: P pairs, N = 2P sequences of a step, S sequences of a micro-batch, B rows, T tokens per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from rollouts.backends import TrainingComponents, compute_logprobs, packed_only
from rollouts.data import best_fit_decreasing, pack_samples
from rollouts.data.batching import pad_batch
from rollouts.loops.micro_batches import attention_pair_cost, choose_layout
from rollouts.loops.run.distributed import global_counts, rank_world, same_count_on_every_rank
from rollouts.losses import PairLogps, preference_loss
from rollouts.losses.aggregate import sequence_sums
from rollouts.types import MicroBatch, PreferenceConfig, Sample

Pair = tuple[Sample, Sample]
"""(chosen, rejected), tokenized after one prompt (rollouts.data.tokenize_preference_pair)."""


def _bins(pairs: Sequence[Pair], max_tokens: int, layout: Literal["packed", "padded"]) -> list[list[int]]:
    """Pair indices per micro-batch: packed by best-fit-decreasing on the pair's two lengths, or padded
    as consecutive length-sorted pairs whose rows * longest fit the budget."""
    if layout == "packed":
        return best_fit_decreasing([len(c.tokens) + len(r.tokens) for c, r in pairs], capacity=max_tokens)
    longest = [max(len(c.tokens), len(r.tokens)) for c, r in pairs]
    bins: list[list[int]] = []
    for k in sorted(range(len(pairs)), key=lambda k: (-longest[k], k)):
        if bins and 2 * (len(bins[-1]) + 1) * longest[bins[-1][0]] <= max_tokens:
            bins[-1].append(k)
        else:
            bins.append([k])
    return bins


def pair_micro_batches(
    pairs: Sequence[Pair],
    *,
    max_tokens: int,
    layout: Literal["packed", "padded"] = "packed",
    pair_ids: Sequence[int] | None = None,
) -> list[MicroBatch[np.ndarray]]:
    """Micro-batches of at most `max_tokens` (B * T) tokens, each pair's two sequences in the same one;
    pair k (or pair_ids[k]) is samples 2k (chosen) and 2k + 1 (rejected)."""
    ids = list(range(len(pairs)) if pair_ids is None else pair_ids)
    if len(ids) != len(pairs):
        raise ValueError(f"pair_ids has {len(ids)} entries for {len(pairs)} pairs: one per pair")
    for k, (c, r) in enumerate(pairs):
        need = len(c.tokens) + len(r.tokens) if layout == "packed" else 2 * max(len(c.tokens), len(r.tokens))
        if need > max_tokens:
            raise ValueError(f"pair {ids[k]} needs {need} tokens > max_tokens {max_tokens}: it fits no micro-batch")
    out = []
    for bin_pairs in _bins(pairs, max_tokens, layout):
        samples = [s for k in bin_pairs for s in pairs[k]]
        indices = np.asarray([2 * ids[k] + j for k in bin_pairs for j in (0, 1)], dtype=np.int64)
        if layout == "packed":
            (mb,) = pack_samples(samples, max_tokens=sum(len(s.tokens) for s in samples))
            out.append(mb.replace(sample_indices=indices[mb.sample_indices]))
        else:
            out.append(pad_batch(samples, pad_id=0, sample_indices=indices.tolist()))
    return out


def chosen_loss_tokens(micro_batches: Sequence[MicroBatch[np.ndarray]]) -> int:
    """Tokens with loss_mask > 0 in the chosen sequences (even sample indices) of the micro-batches."""
    total = 0
    for mb in micro_batches:
        seg = mb.segment_ids
        chosen = np.where(seg >= 0, mb.sample_indices[np.maximum(seg, 0)] % 2 == 0, False)
        total += int(((mb.loss_mask > 0) & chosen).sum())
    return total


def model_layout(components: TrainingComponents, pairs: Sequence[Pair], max_tokens: int) -> Literal["packed", "padded"]:
    """The micro-batch layout SFT and RL would choose for these sequences on this model."""
    model = components.model
    return choose_layout(
        [s for pair in pairs for s in pair],
        packed_only=packed_only(model),
        pair_cost=attention_pair_cost(getattr(model, "config", None)),
        max_tokens=max_tokens,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PairShard:
    """This rank's micro-batches of a step and the step-wide counts the loss divides by."""

    micro_batches: tuple[MicroBatch[np.ndarray], ...]
    """This rank's pairs (the step's pairs[rank::world]), then zero-loss fillers up to the busiest rank's count."""
    num_pairs: int
    """Pairs of the whole step, over every rank."""
    num_chosen_tokens: int
    """Loss tokens of the step's chosen sequences, over every rank (ORPO's NLL denominator)."""


def plan_pair_shard(components: TrainingComponents, pairs: Sequence[Pair], *, max_tokens: int) -> PairShard:
    """Plan this rank's share of a step's pairs (one process: all of them); sample indices are the step's."""
    rank, world = rank_world()
    if len(pairs) < world:
        raise ValueError(f"dpo.batch_size of {len(pairs)} pairs cannot give each of {world} ranks one")
    local = list(pairs[rank::world])
    ids = list(range(rank, len(pairs), world))
    layout = model_layout(components, local, max_tokens)
    planned = pair_micro_batches(local, max_tokens=max_tokens, layout=layout, pair_ids=ids)
    num_chosen_tokens, num_pairs = global_counts(chosen_loss_tokens(planned), len(local))
    return PairShard(
        micro_batches=tuple(same_count_on_every_rank(planned)),
        num_pairs=num_pairs,
        num_chosen_tokens=num_chosen_tokens,
    )


def sequence_logps(logprobs_B_T: Tensor, batch: MicroBatch[Tensor]) -> tuple[Tensor, Tensor]:
    """[S] summed log-probs over each sequence's loss tokens, and [S] its number of loss tokens."""
    selected_B_T = batch.loss_mask > 0
    num = int(batch.sample_indices.shape[0])
    logps_S = sequence_sums(torch.where(selected_B_T, logprobs_B_T, 0.0), batch.segment_ids)[:num]
    tokens_S = sequence_sums(selected_B_T.to(logprobs_B_T.dtype), batch.segment_ids)[:num]
    return logps_S, tokens_S


def pair_rows(sample_indices_S: Tensor) -> tuple[Tensor, Tensor]:
    """Positions of the chosen and of the rejected sequence of each pair in a micro-batch ([P] each, pair order)."""
    if sample_indices_S.shape[0] % 2:
        raise ValueError(f"a micro-batch holds whole pairs, got {sample_indices_S.shape[0]} sequences")
    order_S = torch.argsort(sample_indices_S)  # 2k then 2k + 1: chosen then rejected of each pair
    return order_S[0::2], order_S[1::2]


@dataclass(frozen=True, slots=True, kw_only=True)
class PreferenceLossFn:
    """The preference loss for `forward_backward` on micro-batches from `pair_micro_batches`: per-sequence
    log-probs, paired by sample index, against the step's reference log-probs."""

    config: PreferenceConfig
    ref_logps_N: Tensor | None
    """[N] the step's reference log-probs by sample index (None for the reference-free losses)."""
    num_pairs: int
    """Pairs of the whole step (the mean's denominator)."""
    num_chosen_tokens: int
    """Chosen loss tokens of the whole step (ORPO's NLL denominator)."""
    needs_entropy: bool = False

    def __call__(
        self,
        logprobs_B_T: Tensor,
        batch: MicroBatch[Tensor],
        *,
        num_tokens: int | None = None,
        num_sequences: int | None = None,
        entropy_B_T: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """[B, T] log-probs, micro-batch -> (this micro-batch's share of the step's loss, 0-dim tensor metrics).

        A filler micro-batch (every loss_mask 0) gives a zero loss that still reaches the graph.
        """
        if not bool((batch.loss_mask > 0).any()):
            return logprobs_B_T.sum() * 0.0, {}
        logps_S, tokens_S = sequence_logps(logprobs_B_T, batch)
        chosen_P, rejected_P = pair_rows(batch.sample_indices)
        refs: dict[str, Tensor] = {}
        if self.ref_logps_N is not None:
            ref_S = self.ref_logps_N.to(logps_S.device, logps_S.dtype)[batch.sample_indices]
            refs = {"ref_chosen_P": ref_S[chosen_P], "ref_rejected_P": ref_S[rejected_P]}
        logps = PairLogps(
            chosen_P=logps_S[chosen_P],
            rejected_P=logps_S[rejected_P],
            chosen_tokens_P=tokens_S[chosen_P],
            rejected_tokens_P=tokens_S[rejected_P],
            **refs,
        )
        loss, metrics = preference_loss(
            logps, self.config, num_pairs=self.num_pairs, num_chosen_tokens=self.num_chosen_tokens
        )
        return loss, {"loss": loss.detach()} | metrics


def sequence_logps_of(
    components: TrainingComponents, pairs: Sequence[Pair], *, max_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """[2P] float64 summed log-probs over each sequence's loss tokens under the model as it is (no
    gradients), and [2P] its loss-token counts; sample 2k is pair k's chosen, 2k + 1 its rejected."""
    micro_batches = pair_micro_batches(pairs, max_tokens=max_tokens, layout=model_layout(components, pairs, max_tokens))
    logps_N = np.zeros(2 * len(pairs), dtype=np.float64)
    tokens_N = np.zeros(2 * len(pairs), dtype=np.float64)
    for mb, logprobs in zip(micro_batches, compute_logprobs(components, micro_batches), strict=True):
        for s, index in enumerate(mb.sample_indices.tolist()):
            selected = (mb.segment_ids == s) & (mb.loss_mask > 0)
            logps_N[index] = logprobs[selected].sum(dtype=np.float64)
            tokens_N[index] = float(selected.sum())
    return logps_N, tokens_N
