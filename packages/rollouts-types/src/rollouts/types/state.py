"""TrainingState: the counters of a run, changed only by returning a new state."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingState:
    """Everything that counts a run's progress. Transitions return new states."""

    step: int = 0
    """Optimizer steps taken (skipped non-finite steps do not count)."""
    weight_version: int = 0
    """Version of the weights last synced to the inference engines."""
    tokens_seen: int = 0
    """Loss tokens trained on so far."""
    samples_seen: int = 0
    """Samples trained on so far."""
    skipped_steps: int = 0
    """Optimizer steps skipped because a loss or gradient was not finite (total)."""
    consecutive_skipped_steps: int = 0
    """Skipped steps since the last step that applied; reset to 0 by an applied step."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainingState.{f.name} must be a non-negative int, got {value!r}")

    def after_step(self, *, num_tokens: int, num_samples: int) -> TrainingState:
        """The state after an applied optimizer step over `num_tokens` loss tokens."""
        return dataclasses.replace(
            self,
            step=self.step + 1,
            tokens_seen=self.tokens_seen + num_tokens,
            samples_seen=self.samples_seen + num_samples,
            consecutive_skipped_steps=0,
        )

    def after_skip(self) -> TrainingState:
        """The state after an optimizer step skipped for a non-finite loss or gradient."""
        return dataclasses.replace(
            self,
            skipped_steps=self.skipped_steps + 1,
            consecutive_skipped_steps=self.consecutive_skipped_steps + 1,
        )

    def with_weight_version(self, weight_version: int) -> TrainingState:
        """The state after the engines were given weights of `weight_version`."""
        if weight_version < self.weight_version:
            raise ValueError(f"weight_version may only grow: {weight_version} < current {self.weight_version}")
        return dataclasses.replace(self, weight_version=weight_version)

    def to_dict(self) -> dict[str, int]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingState:
        """Inverse of `to_dict`; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TrainingState.from_dict: unknown keys {unknown}; allowed: {sorted(known)}")
        return cls(**data)
