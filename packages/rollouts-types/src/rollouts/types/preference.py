"""Offline preference optimization configs: which loss and its options (PreferenceConfig), and a
DPO training run (DPOConfig), frozen and validated like every config (see configs.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from rollouts.types.configs import CheckpointConfig, OptimizerConfig
from rollouts.types.validation import check_fields, require

__all__ = ["PREFERENCE_LOSSES", "REFERENCE_FREE_LOSSES", "DPOConfig", "PreferenceConfig", "PreferenceLoss"]

PreferenceLoss = Literal["sigmoid", "robust", "ipo", "hinge", "simpo", "orpo", "kto"]
PREFERENCE_LOSSES: tuple[str, ...] = get_args(PreferenceLoss)
REFERENCE_FREE_LOSSES = frozenset({"simpo", "orpo"})
"""Losses that never read a reference model's log-probs (none is computed for them)."""
_SMOOTHED = frozenset({"sigmoid", "robust", "simpo"})
"""Losses that take label_smoothing (the others would ignore it)."""


def _check_preference(obj: Any, name: str) -> None:
    """The rules of the loss options, shared by PreferenceConfig and DPOConfig (`name` prefixes errors)."""
    require(math.isfinite(obj.beta) and obj.beta > 0, f"{name}.beta", obj.beta, "be a finite number > 0")
    require(0.0 <= obj.label_smoothing < 0.5, f"{name}.label_smoothing", obj.label_smoothing, "be in [0, 0.5)")
    require(
        obj.label_smoothing == 0.0 or obj.loss in _SMOOTHED,
        f"{name}.label_smoothing",
        obj.label_smoothing,
        f"be 0 with loss {obj.loss!r} (only {sorted(_SMOOTHED)} take it)",
    )
    require(
        math.isfinite(obj.simpo_gamma) and obj.simpo_gamma >= 0,
        f"{name}.simpo_gamma",
        obj.simpo_gamma,
        "be a finite number >= 0",
    )
    for weight in ("desirable_weight", "undesirable_weight"):
        value = getattr(obj, weight)
        require(math.isfinite(value) and value > 0, f"{name}.{weight}", value, "be a finite number > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class PreferenceConfig:
    """A preference loss and its options (formulas in rollouts.losses.preference)."""

    loss: PreferenceLoss = "sigmoid"
    """"sigmoid" (DPO; with label_smoothing: conservative DPO), "robust" (robust DPO), "ipo", "hinge",
    "simpo" and "orpo" (no reference model), "kto" (paired KTO)."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward beta * log(pi / pi_ref) (IPO's tau; ORPO's lambda)."""
    label_smoothing: float = 0.0
    """Assumed fraction of flipped preference labels (sigmoid, robust, simpo)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (the loss subtracts gamma from beta times the margin)."""
    desirable_weight: float = 1.0
    """KTO: weight of the chosen completions' losses."""
    undesirable_weight: float = 1.0
    """KTO: weight of the rejected completions' losses."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check_preference(self, "PreferenceConfig")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads reference log-probs (all but SimPO and ORPO)."""
        return self.loss not in REFERENCE_FREE_LOSSES


@dataclass(frozen=True, slots=True, kw_only=True)
class DPOConfig:
    """Offline preference optimization on (prompt, chosen, rejected) pairs: the loss options of
    PreferenceConfig, flat, plus batching, evaluation, optimizer and checkpoints."""

    num_steps: int = 100
    batch_size: int = 16
    """Preference pairs per optimizer step."""
    max_length: int = 1024
    """Tokens of one sequence (prompt + completion); longer ones are cut at the end."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one micro-batch; a pair's chosen and rejected always share one."""
    seed: int = 0
    log_every: int = 1
    eval_every_steps: int = 0
    """Held-out preference accuracy on data.eval_path after every this many steps and the last; 0: never."""
    loss: PreferenceLoss = "sigmoid"
    """"sigmoid" (DPO; with label_smoothing: conservative DPO), "robust" (robust DPO), "ipo", "hinge",
    "simpo" and "orpo" (no reference model), "kto" (paired KTO)."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward beta * log(pi / pi_ref) (IPO's tau; ORPO's lambda)."""
    label_smoothing: float = 0.0
    """Assumed fraction of flipped preference labels (sigmoid, robust, simpo)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin."""
    desirable_weight: float = 1.0
    """KTO: weight of the chosen completions' losses."""
    undesirable_weight: float = 1.0
    """KTO: weight of the rejected completions' losses."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-7))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        n = "DPOConfig"
        require(self.num_steps >= 1, f"{n}.num_steps", self.num_steps, "be >= 1")
        require(self.batch_size >= 1, f"{n}.batch_size", self.batch_size, "be >= 1")
        require(self.max_length >= 2, f"{n}.max_length", self.max_length, "be >= 2")
        require(
            self.max_tokens_per_micro_batch >= 2 * self.max_length,
            f"{n}.max_tokens_per_micro_batch",
            self.max_tokens_per_micro_batch,
            f"be >= 2 * max_length ({2 * self.max_length}) so a pair's two sequences fit one micro-batch",
        )
        require(self.seed >= 0, f"{n}.seed", self.seed, "be >= 0")
        require(self.log_every >= 1, f"{n}.log_every", self.log_every, "be >= 1")
        require(self.eval_every_steps >= 0, f"{n}.eval_every_steps", self.eval_every_steps, "be >= 0")
        _check_preference(self, n)

    @property
    def preference(self) -> PreferenceConfig:
        """The loss options as a PreferenceConfig."""
        return PreferenceConfig(
            loss=self.loss,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            simpo_gamma=self.simpo_gamma,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )
