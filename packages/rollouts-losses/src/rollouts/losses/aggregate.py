"""Reduce a per-token loss to a scalar, on padded or packed rows, with step-wide denominators.

Legend: B rows, T tokens per row, S sequences (bins; on packed rows S = B * T, most of them empty).

Modes follow verl's `agg_loss` (verl/trainer/ppo/core_algos.py as of 2026-11, its rewrite with
`global_batch_size` / `loss_scale_factor`) or TRL's GRPO `loss_type` (trl/trainer/grpo_trainer.py):
  token-mean               sum(loss * mask) / sum(mask)               verl "token-mean"; TRL "dapo"
  token-sum                sum(loss * mask)                           (no peer mode)
  seq-mean-token-sum       sum over sequences of sum(loss * mask) / number of sequences
                                                                      verl "seq-mean-token-sum"
  seq-mean-token-mean      sum over sequences of [sum(loss * mask) / sum(mask)] / number of sequences
                                                                      verl "seq-mean-token-mean"; TRL "grpo"
  seq-mean-token-sum-norm  sum over sequences of [sum(loss * mask) / norm_constant] / number of
                           sequences (Dr.GRPO; default norm: the padded length T): TRL "dr_grpo",
                           which divides the token sum by batch_size * max_completion_length (the
                           same when every sequence has loss tokens).
                           verl's "seq-mean-token-sum-norm" divides the summed sequence losses by
                           the constant only, number-of-sequences times this; `token-sum` with the
                           loss divided by the constant gives verl's.
The number of sequences counts only sequences with at least one loss token, as current verl does
(a sample fully masked by overlong filtering, or a tool-only turn, is not a sequence of the mean),
in the local count and in the step-wide `num_sequences` alike (rollouts-data's StepPlan counts
the same way).

Departures from verl: seq-mean-token-sum-norm follows TRL and the Dr.GRPO paper's 1/G (a loss
whose size does not grow with the number of sequences in a step, so gradient clipping and the
learning rate mean the same at any batch size); a sequence (or a batch) without loss tokens
contributes 0 instead of NaN; rows may be packed (`segment_ids_B_T`: several sequences in one row,
-1 on padding); and the denominators can be given for the whole step (`num_tokens`, `num_sequences`) so that summing the
losses of a step's micro-batches equals the loss of the step as one batch. With packed rows and
no `norm_constant`, seq-mean-token-sum-norm divides by the longest sequence in the rows (the T the
sequences would have padded to): give the constant (the generation limit) to keep it fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from rollouts.types.configs import LossAggregation

__all__ = ["AGGREGATION_MODES", "DEFAULT_REDUCTION", "Aggregation", "Reduction", "aggregate"]

Aggregation = LossAggregation
AGGREGATION_MODES: tuple[str, ...] = get_args(Aggregation)


def check_mode(mode: str) -> None:
    """Raise unless mode is one of AGGREGATION_MODES."""
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"mode must be one of {AGGREGATION_MODES}, got {mode!r}")


def check_same_shape(**tensors: Tensor | None) -> None:
    """Raise unless every given tensor is [B, T] with one shared shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"per-token tensors must all be [B, T] with one shape, got {shapes}")


def safe_divide(numerator: Tensor, denominator: Tensor | float) -> Tensor:
    """numerator / denominator, or 0 where the denominator is 0 (an empty set of tokens contributes nothing)."""
    if not isinstance(denominator, Tensor):
        # a fill on the device: as_tensor of a host number copies it in, and that copy waits for the stream
        denominator = torch.full((), denominator, dtype=numerator.dtype, device=numerator.device)
    denominator = denominator.to(dtype=numerator.dtype, device=numerator.device)
    nonzero = denominator != 0
    return torch.where(nonzero, numerator / torch.where(nonzero, denominator, 1.0), 0.0)


def sequence_sums(x_B_T: Tensor, segment_ids_B_T: Tensor | None) -> Tensor:
    """[B, T] -> [S] per-sequence sums (S = B without segment ids, else B * T bins indexed by segment id)."""
    if segment_ids_B_T is None:
        return x_B_T.sum(dim=-1)
    seg_N = segment_ids_B_T.reshape(-1)
    valid_N = seg_N >= 0
    values_N = torch.where(valid_N, x_B_T.reshape(-1), 0.0)
    return torch.zeros(seg_N.numel(), dtype=x_B_T.dtype, device=x_B_T.device).index_add(0, seg_N.clamp(min=0), values_N)


def to_tokens(x_S: Tensor, segment_ids_B_T: Tensor | None, shape: torch.Size) -> Tensor:
    """[S] per-sequence values -> [B, T] on the tokens of each sequence (0 on padding of packed rows)."""
    if segment_ids_B_T is None:
        return x_S[:, None].expand(shape)
    gathered = x_S[segment_ids_B_T.clamp(min=0)]
    return torch.where(segment_ids_B_T >= 0, gathered, 0.0)


def sequence_present(mask_B_T: Tensor, segment_ids_B_T: Tensor | None) -> Tensor:
    """[S] bool: which sequence bins hold a sequence with at least one loss token (mask > 0)."""
    return sequence_sums((mask_B_T > 0).to(torch.float32), segment_ids_B_T) > 0


def _default_norm(mask_B_T: Tensor, segment_ids_B_T: Tensor | None) -> Tensor | float:
    """The padded length T, or on packed rows the longest sequence's length."""
    if segment_ids_B_T is None:
        return float(mask_B_T.shape[-1])
    return sequence_sums(torch.ones_like(mask_B_T, dtype=torch.float32), segment_ids_B_T).max()


def _check_count(name: str, value: int | None) -> None:
    """Raise unless value is None or a non-negative int."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a non-negative int (a count for the whole step) or None, got {value!r}")


def aggregate(
    loss_B_T: Tensor,
    mask_B_T: Tensor,
    mode: Aggregation = "token-mean",
    *,
    norm_constant: float | None = None,
    segment_ids_B_T: Tensor | None = None,
    num_tokens: int | None = None,
    num_sequences: int | None = None,
) -> Tensor:
    """[B, T] loss, [B, T] mask -> scalar loss reduced by mode (see the module docstring).

    num_tokens / num_sequences: the step-wide denominators (count of loss tokens, of sequences);
    None uses this batch's own (sum of the mask, sequences present).
    """
    check_mode(mode)
    check_same_shape(loss_B_T=loss_B_T, mask_B_T=mask_B_T, segment_ids_B_T=segment_ids_B_T)
    _check_count("num_tokens", num_tokens)
    _check_count("num_sequences", num_sequences)
    if norm_constant is not None and not norm_constant > 0:
        raise ValueError(f"norm_constant must be > 0 or None, got {norm_constant!r}")
    denominators = {
        "token-mean": ("num_tokens", num_tokens),
        "seq-mean-token-sum": ("num_sequences", num_sequences),
        "seq-mean-token-mean": ("num_sequences", num_sequences),
        "seq-mean-token-sum-norm": ("num_sequences", num_sequences),
    }
    name, count = denominators.get(mode, ("", None))
    # A zero step-wide count with loss tokens here would divide them away to a zero loss and silently
    # drop this micro-batch's gradient. Checked on CPU tensors only: on a device, reading the mask
    # would wait for every kernel queued before it.
    if count == 0 and mask_B_T.device.type == "cpu" and bool((mask_B_T != 0).any()):
        raise ValueError(f"{name}=0 for a batch that has loss tokens: the step-wide count must include them")
    mask_B_T = mask_B_T.to(loss_B_T.dtype)
    # where(), not a product alone: inf or NaN on masked-out tokens must not leak into the sum
    weighted_B_T = torch.where(mask_B_T != 0, loss_B_T * mask_B_T, 0.0)
    if mode == "token-sum":
        return weighted_B_T.sum()
    if mode == "token-mean":
        denominator = mask_B_T.sum() if num_tokens is None else num_tokens
        return safe_divide(weighted_B_T.sum(), denominator)
    per_seq_S = sequence_sums(weighted_B_T, segment_ids_B_T)
    if mode == "seq-mean-token-sum-norm":
        norm = _default_norm(mask_B_T, segment_ids_B_T) if norm_constant is None else norm_constant
        per_seq_S = safe_divide(per_seq_S, norm)
    if mode == "seq-mean-token-mean":
        per_seq_S = safe_divide(per_seq_S, sequence_sums(mask_B_T, segment_ids_B_T))
    if num_sequences is None:
        denominator = sequence_present(mask_B_T, segment_ids_B_T).sum().to(loss_B_T.dtype)
    else:
        denominator = num_sequences
    return safe_divide(per_seq_S.sum(), denominator)


def masked_mean(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Mean of x over tokens where mask > 0 (0 when there are none); for metrics."""
    selected = mask_B_T > 0
    return safe_divide(torch.where(selected, x_B_T, 0.0).sum(), selected.sum().to(x_B_T.dtype))


@dataclass(frozen=True, slots=True, kw_only=True)
class Reduction:
    """How a loss reduces its per-token values to a scalar: the options of `aggregate`, as one value.

    Every loss takes one; the default (`DEFAULT_REDUCTION`) is the loss's own mode on padded rows
    with this batch's own denominators.
    """

    mode: Aggregation | None = None
    """How to reduce (see the module docstring); None: the loss's own default mode."""
    norm_constant: float | None = None
    """Divisor for seq-mean-token-sum-norm (None: the padded length, or the longest packed sequence)."""
    segment_ids_B_T: Tensor | None = None
    """[B, T] each token's sequence index on packed rows, -1 on padding; None: one sequence per row."""
    num_tokens: int | None = None
    """The step-wide count of loss tokens (None: this batch's own)."""
    num_sequences: int | None = None
    """The step-wide count of sequences with a loss token (None: this batch's own)."""

    def apply(self, loss_B_T: Tensor, mask_B_T: Tensor, default_mode: Aggregation = "token-mean") -> Tensor:
        """`aggregate` of [B, T] loss and mask with these options; mode None reduces by default_mode."""
        return aggregate(
            loss_B_T,
            mask_B_T,
            default_mode if self.mode is None else self.mode,
            norm_constant=self.norm_constant,
            segment_ids_B_T=self.segment_ids_B_T,
            num_tokens=self.num_tokens,
            num_sequences=self.num_sequences,
        )


DEFAULT_REDUCTION = Reduction()
"""The loss's own mode, padded rows, this batch's own denominators."""
