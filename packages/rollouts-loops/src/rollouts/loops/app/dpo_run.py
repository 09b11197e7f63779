"""The `rollouts dpo` run file: a model, preference pairs, and a DPOConfig under [dpo] (no torch here:
the CLI loads and checks it before the training stack is imported)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollouts.loops.app.config import DataSpec, LogSpec, ModelSpec, RunSpec
from rollouts.types import DPOConfig, check_fields


@dataclass(frozen=True, slots=True, kw_only=True)
class DPORun:
    """`rollouts dpo`: a model, preference pairs ({"prompt", "chosen", "rejected"} records in
    data.train_path; held-out ones in data.eval_path, its first data.num_eval), and a DPOConfig."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    run: RunSpec = field(default_factory=RunSpec)
    log: LogSpec = field(default_factory=LogSpec)
    dpo: DPOConfig = field(default_factory=DPOConfig)

    def __post_init__(self) -> None:
        check_fields(self)
