"""LoRA adapter settings: which linear layers get low-rank adapters, their rank and scale.

rank 0 means no adapter (full fine-tuning); `model.lora.rank = 8` in a run file switches LoRA on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from rollouts.types.validation import check_fields, require

__all__ = ["DEFAULT_LORA_TARGETS", "LoraConfig", "LoraSync"]

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Attention and MLP projections of Llama/Qwen/Mistral-style models (the names vLLM serves LoRA on)."""

LoraSync = Literal["adapter", "merged"]
"""How trained adapters reach an engine: the adapter alone (runtime LoRA loading) or merged full weights."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraConfig:
    """A LoRA adapter on the model's linear layers (built with PEFT); rank 0: no adapter."""

    rank: int = 0
    """Adapter rank r (0: LoRA off, every weight trains)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training."""
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS
    """Names of the linear modules (last name component, or a full-name regex) that get adapters."""
    sync: LoraSync = "adapter"
    """Engine sync: 'adapter' loads only the adapter (vLLM runtime LoRA); 'merged' sends merged full weights."""

    def __post_init__(self) -> None:
        check_fields(self)
        n = "LoraConfig"
        require(self.rank >= 0, f"{n}.rank", self.rank, "be >= 0 (0: no adapter)")
        require(self.alpha > 0, f"{n}.alpha", self.alpha, "be > 0")
        require(0.0 <= self.dropout < 1.0, f"{n}.dropout", self.dropout, "be in [0, 1)")
        require(len(self.target_modules) >= 1, f"{n}.target_modules", self.target_modules, "name at least one module")
        for i, name in enumerate(self.target_modules):
            require(bool(name.strip()), f"{n}.target_modules[{i}]", name, "be a non-empty module name")
            try:
                re.compile(name)
            except re.error as e:
                raise ValueError(f"{n}.target_modules[{i}] = {name!r} must be a module name or regex: {e}") from None

    @property
    def enabled(self) -> bool:
        return self.rank > 0
