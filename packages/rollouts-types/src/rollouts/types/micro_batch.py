"""MicroBatch: the arrays one forward/backward pass consumes, in numpy (built by rollouts-data) or
torch (moved by rollouts-backends); generic over the array type so this package stays stdlib-only.

Legend: B rows, T tokens per row, S sequences in the micro-batch.

Every per-token array is [B, T] and aligned with `input_ids`: entry t concerns token t, so the
first token of each sequence carries no loss (nothing predicts it). Two layouts: padded (one
sequence per row, right padding) and packed (B == 1, sequences back to back, `cu_seqlens` marks
the boundaries). A micro-batch is frozen: add or change arrays with `replace`, convert them with
`map`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

__all__ = ["MicroBatch"]

A = TypeVar("A")
B = TypeVar("B")

_TOKEN_FIELDS = (
    "input_ids",
    "position_ids",
    "segment_ids",
    "attention_mask",
    "loss_mask",
    "advantages",
    "rollout_logprobs",
    "old_logprobs",
    "ref_logprobs",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatch(Generic[A]):
    """One micro-batch; shapes in each field's docstring (array type A: numpy or torch)."""

    input_ids: A
    """[B, T] int: token ids; padding holds the pad id."""
    position_ids: A
    """[B, T] int: position within its sequence (restarts at 0 for every packed sequence; 0 on padding)."""
    segment_ids: A
    """[B, T] int: which sequence of the micro-batch a token belongs to (0..S-1), -1 on padding. A
    model that takes a dense mask must attend within a segment only: see rollouts.data's
    `segment_attention_mask` (packed rows otherwise leak attention across sequences)."""
    attention_mask: A
    """[B, T] int: 1 on real tokens, 0 on padding. Marks padding only, never sequence boundaries."""
    loss_mask: A
    """[B, T] float: per-token loss weight (0 on prompts, tool output, padding and sequence starts)."""
    sample_indices: A
    """[S] int: the index, in the step's list of samples, of each sequence (row order when padded,
    segment order when packed)."""
    cu_seqlens: A | None = None
    """[S + 1] int32: cumulative sequence lengths of the packed row (packed layout only)."""
    advantages: A | None = None
    """[B, T] float: per-token advantage (RL)."""
    rollout_logprobs: A | None = None
    """[B, T] float: the engine's log-probs of the sampled tokens (0 on prompts)."""
    old_logprobs: A | None = None
    """[B, T] float: the trainer's log-probs before this step's updates (PPO-style ratios)."""
    ref_logprobs: A | None = None
    """[B, T] float: the reference model's log-probs (KL)."""
    extras: Mapping[str, A] = field(default_factory=lambda: MappingProxyType({}))
    """Further [B, T] per-token arrays by name, for losses of one's own (e.g. values, returns)."""

    def __post_init__(self) -> None:
        shape = _shape(self.input_ids)
        if shape is not None and (len(shape) != 2 or shape[1] < 1):
            raise ValueError(f"MicroBatch.input_ids must be [B, T] with T >= 1, got shape {tuple(shape)}")
        if not isinstance(self.extras, Mapping):
            raise TypeError(f"MicroBatch.extras must be a mapping of name -> array, got {type(self.extras).__name__}")
        clash = sorted(set(self.extras) & {f.name for f in dataclasses.fields(self)})
        if clash:
            raise ValueError(f"MicroBatch.extras {clash} name fields of MicroBatch itself: set those fields instead")
        object.__setattr__(self, "extras", MappingProxyType(dict(self.extras)))
        if shape is None:
            return
        for name, value in self.token_arrays().items():
            other = _shape(value)
            if other is not None and tuple(other) != tuple(shape):
                raise ValueError(
                    f"MicroBatch.{name} has shape {tuple(other)} but input_ids has {tuple(shape)}: "
                    "per-token arrays align with input_ids"
                )

    @property
    def packed(self) -> bool:
        """Whether this is the packed layout (one row of sequences back to back)."""
        return self.cu_seqlens is not None

    def token_arrays(self) -> dict[str, A]:
        """Every [B, T] array present (None fields left out), extras included, by name."""
        out = {name: getattr(self, name) for name in _TOKEN_FIELDS if getattr(self, name) is not None}
        return out | dict(self.extras)

    def get(self, name: str) -> A | None:
        """A field or an extra by name; None when absent."""
        if name in self.extras:
            return self.extras[name]
        if name in _TOKEN_FIELDS or name in ("sample_indices", "cu_seqlens"):
            value: A | None = getattr(self, name)
            return value
        return None

    def replace(self, **changes: Any) -> MicroBatch[A]:
        """A copy with fields changed; unknown names go to `extras` (merged with the existing ones)."""
        names = {f.name for f in dataclasses.fields(self)}
        extras = {k: v for k, v in changes.items() if k not in names}
        fields_ = {k: v for k, v in changes.items() if k in names}
        if extras:
            fields_["extras"] = {**fields_.get("extras", self.extras), **extras}
        return dataclasses.replace(self, **fields_)

    def map(self, fn: Callable[[str, A], B]) -> MicroBatch[B]:
        """The same micro-batch with every array converted: fn(name, array) -> new array."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extras":
                values["extras"] = {k: fn(k, v) for k, v in value.items()}
            else:
                values[f.name] = None if value is None else fn(f.name, value)
        return MicroBatch(**values)


def _shape(value: Any) -> tuple[int, ...] | None:
    """An array's shape, or None for values that have none (checked where the array type is known)."""
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(shape)
