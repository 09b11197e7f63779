"""Frozen, validated configs. Build them in code, or from a (TOML) mapping with `from_dict`.

Every config type-checks its fields against their annotations and range-checks its values in
`__post_init__`; errors name the field, the value and the rule. `dataclasses.asdict(config)`
followed by `from_dict(type(config), ...)` gives back an equal config. AlgorithmConfig lives in
`algorithm.py` and is re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from rollouts.types.algorithm import (
    GROUP_ESTIMATORS,
    PEER_BASELINE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageScale,
    AlgorithmConfig,
    ISLevel,
    ISMode,
    KLKind,
    KLPlacement,
    LossAggregation,
    PolicyLoss,
    RejectionEstimator,
    RejectionLevel,
)
from rollouts.types.validation import check_fields, from_dict, require

Schedule = Literal["constant", "linear", "cosine"]
TrainOn = Literal["assistant", "last_assistant", "all"]

__all__ = [
    "GROUP_ESTIMATORS",
    "PEER_BASELINE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageScale",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ISLevel",
    "ISMode",
    "KLKind",
    "KLPlacement",
    "LossAggregation",
    "OptimizerConfig",
    "PolicyLoss",
    "CriticConfig",
    "RLConfig",
    "ReferenceConfig",
    "ReferenceUpdate",
    "RejectionEstimator",
    "RejectionLevel",
    "RolloutConfig",
    "SFTConfig",
    "SamplingParams",
    "Schedule",
    "TrainOn",
    "from_dict",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule, gradient clipping and the non-finite guard."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    """Applied to matrices only; norms and biases never decay."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping)."""
    warmup_steps: int = 0
    schedule: Schedule = "cosine"
    """Shape of the learning rate after warm-up, over the run's total steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr` (cosine and linear)."""
    max_consecutive_skips: int = 3
    """Raise after this many optimizer steps in a row were skipped for non-finite values."""

    def __post_init__(self) -> None:
        check_fields(self)
        n = "OptimizerConfig"
        require(self.lr > 0, f"{n}.lr", self.lr, "be > 0")
        for i, b in enumerate(self.betas):
            require(0.0 <= b < 1.0, f"{n}.betas[{i}]", b, "be in [0, 1)")
        require(self.eps > 0, f"{n}.eps", self.eps, "be > 0")
        require(self.weight_decay >= 0, f"{n}.weight_decay", self.weight_decay, "be >= 0")
        if self.max_grad_norm is not None:
            require(self.max_grad_norm > 0, f"{n}.max_grad_norm", self.max_grad_norm, "be > 0 or None")
        require(self.warmup_steps >= 0, f"{n}.warmup_steps", self.warmup_steps, "be >= 0")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"{n}.min_lr_ratio", self.min_lr_ratio, "be in [0, 1]")
        require(self.max_consecutive_skips >= 1, f"{n}.max_consecutive_skips", self.max_consecutive_skips, "be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointConfig:
    """When to checkpoint and how many checkpoints to keep."""

    every_steps: int = 0
    """Save every this many optimizer steps (0: only at the end of the run)."""
    keep_last: int = 2
    """Keep the newest this many complete checkpoints; older ones are deleted."""
    save_optimizer: bool = True
    """Save optimizer and scheduler state (needed for exact resume)."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.every_steps >= 0, "CheckpointConfig.every_steps", self.every_steps, "be >= 0")
        require(self.keep_last >= 1, "CheckpointConfig.keep_last", self.keep_last, "be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How an inference engine samples one request's responses."""

    n: int = 1
    """Responses per prompt (under a RolloutConfig, `samples_per_prompt` says it: leave n at 1)."""
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1: no top-k truncation."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a response stops after any of these tokens (the engine's EOS is added by it)."""
    seed: int | None = None
    logprobs: bool = True
    """Return the log-prob of each sampled token."""

    def __post_init__(self) -> None:
        check_fields(self)
        n = "SamplingParams"
        require(self.n >= 1, f"{n}.n", self.n, "be >= 1")
        require(self.max_new_tokens >= 1, f"{n}.max_new_tokens", self.max_new_tokens, "be >= 1")
        require(self.temperature >= 0.0, f"{n}.temperature", self.temperature, "be >= 0 (0 is greedy)")
        require(0.0 < self.top_p <= 1.0, f"{n}.top_p", self.top_p, "be in (0, 1]")
        require(self.top_k == -1 or self.top_k >= 1, f"{n}.top_k", self.top_k, "be -1 or >= 1")
        for i, t in enumerate(self.stop_token_ids):
            require(t >= 0, f"{n}.stop_token_ids[{i}]", t, "be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutConfig:
    """How a step's samples are generated: sizes, sampling, concurrency and bounds."""

    batch_size: int = 8
    """Prompts (groups) per training step."""
    samples_per_prompt: int = 4
    """Responses per prompt (the GRPO group size)."""
    over_sampling_factor: float = 1.0
    """Ask for this many times `batch_size` groups at once (>1 with dynamic sampling)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards all agree (DAPO) and keep generating until the batch is full."""
    max_generation_rounds: int = 4
    """Bound on rounds of (over-)sampling for one step before giving up on filling it."""
    max_concurrency: int = 32
    """Generate requests in flight at once."""
    request_timeout_s: float = 120.0
    """Bound on one generate request (one group)."""
    max_retries: int = 2
    """Retries of a failed or timed-out generate request before the group counts as failed."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters; the responses per prompt are `samples_per_prompt`, so `sampling.n` must be
    left at 1 or equal it (another value is refused rather than ignored)."""
    tail: str = "wait"
    """"wait": a round waits for every request it sent; "first_n": a round ends as soon as the step's
    groups are kept (the first to finish), and the requests still running are aborted, their prompts
    served first by the next step with the same seeds (cuts the slow tail of long responses)."""
    partial: bool = False
    """Partial rollouts: a weight sync does not wait for the generation in flight; the engine cuts
    the running responses short, they keep their tokens, log-probs and each token's weight version,
    and are continued (not restarted) under the new weights (rl.overlap). A multi-turn episode
    (environment, tool, agent) is continued in place: its turn cut short goes on after the sync and
    its later turns run under the new weights (not with tail "first_n")."""

    def __post_init__(self) -> None:
        check_fields(self)
        n = "RolloutConfig"
        require(self.tail in ("wait", "first_n"), f"{n}.tail", self.tail, "be 'wait' or 'first_n'")
        require(self.batch_size >= 1, f"{n}.batch_size", self.batch_size, "be >= 1")
        require(self.samples_per_prompt >= 1, f"{n}.samples_per_prompt", self.samples_per_prompt, "be >= 1")
        require(
            self.sampling.n in (1, self.samples_per_prompt),
            f"{n}.sampling.n",
            self.sampling.n,
            f"be 1 (unset) or equal samples_per_prompt ({self.samples_per_prompt}): samples_per_prompt is the "
            "number of responses per prompt that counts; set that key alone",
        )
        require(self.over_sampling_factor >= 1.0, f"{n}.over_sampling_factor", self.over_sampling_factor, "be >= 1.0")
        require(self.max_generation_rounds >= 1, f"{n}.max_generation_rounds", self.max_generation_rounds, "be >= 1")
        require(self.max_concurrency >= 1, f"{n}.max_concurrency", self.max_concurrency, "be >= 1")
        require(self.request_timeout_s > 0, f"{n}.request_timeout_s", self.request_timeout_s, "be > 0")
        require(self.max_retries >= 0, f"{n}.max_retries", self.max_retries, "be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class SFTConfig:
    """Supervised fine-tuning on conversations (loss on assistant turns)."""

    num_steps: int = 100
    batch_size: int = 16
    """Samples per optimizer step."""
    max_length: int = 2048
    """Tokens per sample; longer ones are truncated (and reported as truncated)."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one packed micro-batch (gradient accumulation splits the step)."""
    loss_aggregation: LossAggregation = "token-mean"
    train_on: TrainOn = "assistant"
    """Which turns the loss covers."""
    seed: int = 0
    log_every: int = 1
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        n = "SFTConfig"
        require(self.num_steps >= 1, f"{n}.num_steps", self.num_steps, "be >= 1")
        require(self.batch_size >= 1, f"{n}.batch_size", self.batch_size, "be >= 1")
        require(self.max_length >= 2, f"{n}.max_length", self.max_length, "be >= 2")
        require(
            self.max_tokens_per_micro_batch >= self.max_length,
            f"{n}.max_tokens_per_micro_batch",
            self.max_tokens_per_micro_batch,
            f"be >= max_length ({self.max_length}) so every sample fits a micro-batch",
        )
        require(self.seed >= 0, f"{n}.seed", self.seed, "be >= 0")
        require(self.log_every >= 1, f"{n}.log_every", self.log_every, "be >= 1")


ReferenceUpdate = Literal["frozen", "ema", "reset"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceConfig:
    """How the KL reference model moves during RL: not at all (the starting weights), as an
    exponential moving average of the policy, or reset to the policy every N steps."""

    update: ReferenceUpdate = "frozen"
    ema_decay: float = 0.99
    """With "ema": after every optimizer step, reference = ema_decay * reference + (1 - ema_decay) * policy."""
    reset_every_steps: int = 100
    """With "reset": the reference becomes a copy of the policy every this many optimizer steps."""

    def __post_init__(self) -> None:
        check_fields(self)
        n = "ReferenceConfig"
        if self.update == "ema":
            require(0.0 < self.ema_decay < 1.0, f"{n}.ema_decay", self.ema_decay, "be in (0, 1) with update 'ema'")
        require(self.reset_every_steps >= 1, f"{n}.reset_every_steps", self.reset_every_steps, "be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class CriticConfig:
    """PPO's critic (advantage_estimator 'gae'): a value head on a causal LM's backbone."""

    path: str = ""
    """The causal LM the critic starts from (empty: the policy's starting model)."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    clip_range: float | None = 0.2
    """Value clipping around the old values (None: none)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.clip_range is not None:
            require(self.clip_range > 0, "CriticConfig.clip_range", self.clip_range, "be > 0 or None")


@dataclass(frozen=True, slots=True, kw_only=True)
class RLConfig:
    """Reinforcement learning: rollouts, algorithm, optimizer, sync and checkpointing."""

    num_steps: int = 100
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    max_tokens_per_micro_batch: int = 8192
    sync_every_steps: int = 1
    """Export weights and sync the engines every this many steps (batches)."""
    overlap: bool = False
    """Generate step n+1 while step n trains (off-policy by at most `max_staleness` versions)."""
    max_staleness: int = 1
    """With overlap: how many weight versions a sample may lag the trained policy."""
    overlap_is_cap: float | None = 2.0
    """With overlap and no algorithm.is_cap: truncated importance weights (token level) against the
    engine's log-probs at this cap, correcting for samples of an older policy; None: off."""
    sync_probe_tokens: int = 0
    """After each sync, check the engine serves the trained weights: greedy tokens of the first prompt
    whose engine log-probs must match the trainer's (0: off; logged as sync_probe_logprob_diff)."""
    sync_probe_tolerance: float = 1e-2
    """Mean |engine - trainer| log-prob the probe accepts (float32 on both sides: ~1e-5; bf16: ~1e-2)."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The KL reference model's updates (frozen by default)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model of PPO with a critic (used with advantage_estimator 'gae')."""
    correct_min_reward: float = 1.0
    """The reward at or above which a sample counts as correct in the step's `accuracy` and the
    evaluation's pass@k and maj@k; partial credit below it (0.2 for a well-formed wrong answer) is not
    correct. A sample whose metadata["correct"] is a bool (set by a rollout function or environment)
    is judged by that flag instead."""
    seed: int = 0
    log_every: int = 1

    @property
    def num_updates(self) -> int:
        """The optimizer updates the run makes: `num_steps` batches, `num_updates_per_batch` each.
        TrainingState.step counts these."""
        return self.num_steps * self.algorithm.num_updates_per_batch

    @property
    def effective_algorithm(self) -> AlgorithmConfig:
        """The algorithm as trained: with overlap, `overlap_is_cap` fills in an unset is_cap."""
        if self.overlap and self.algorithm.is_cap is None and self.overlap_is_cap is not None:
            return dataclasses.replace(self.algorithm, is_cap=self.overlap_is_cap)
        return self.algorithm

    def __post_init__(self) -> None:
        check_fields(self)
        n = "RLConfig"
        require(self.num_steps >= 1, f"{n}.num_steps", self.num_steps, "be >= 1")
        longest = self.rollout.sampling.max_new_tokens
        require(
            self.max_tokens_per_micro_batch > longest,
            f"{n}.max_tokens_per_micro_batch",
            self.max_tokens_per_micro_batch,
            f"be > rollout.sampling.max_new_tokens ({longest}) so a prompt and a full response fit a micro-batch",
        )
        require(self.sync_every_steps >= 1, f"{n}.sync_every_steps", self.sync_every_steps, "be >= 1")
        group = self.algorithm.advantage_estimator in GROUP_ESTIMATORS
        require(
            not (group and self.rollout.sampling.temperature == 0 and self.rollout.samples_per_prompt > 1),
            f"{n}.rollout.sampling.temperature",
            self.rollout.sampling.temperature,
            f"be > 0 with {self.algorithm.advantage_estimator!r} advantages and samples_per_prompt="
            f"{self.rollout.samples_per_prompt}: greedy samples of a group are identical, so every advantage "
            "is 0 and nothing is learned",
        )
        require(
            not (
                self.algorithm.advantage_estimator in PEER_BASELINE_ESTIMATORS and self.rollout.samples_per_prompt == 1
            ),
            f"{n}.rollout.samples_per_prompt",
            self.rollout.samples_per_prompt,
            f"be >= 2 with {self.algorithm.advantage_estimator!r} advantages: they compare each response with the "
            "others to the same prompt, and a group of one has none (use 'reinforce_pp' or 'remax' for one "
            "response per prompt)",
        )
        require(math.isfinite(self.correct_min_reward), f"{n}.correct_min_reward", self.correct_min_reward, "be finite")
        require(self.max_staleness >= 1, f"{n}.max_staleness", self.max_staleness, "be >= 1")
        require(
            not self.rollout.partial or self.overlap,
            f"{n}.rollout.partial",
            self.rollout.partial,
            "be false without overlap: only with overlap does a weight sync meet generation in flight",
        )
        require(
            self.reference.update == "frozen" or self.algorithm.needs_reference,
            f"{n}.reference.update",
            self.reference.update,
            "be 'frozen' unless the algorithm has a KL term (kl_coef > 0 with a kl_placement): "
            "a reference no loss looks at would be updated for nothing",
        )
        if self.overlap_is_cap is not None:
            require(self.overlap_is_cap >= 1.0, f"{n}.overlap_is_cap", self.overlap_is_cap, "be >= 1 or None")
        corrected = self.effective_algorithm.is_cap is not None or self.effective_algorithm.needs_rollout_logprobs
        require(
            not corrected or self.rollout.sampling.logprobs,
            f"{n}.rollout.sampling.logprobs",
            self.rollout.sampling.logprobs,
            "be true: the off-policy correction (algorithm.is_cap, or overlap_is_cap with overlap) weighs "
            "samples by the engine's log-probs",
        )
        buffer = self.algorithm.overlong_buffer_length
        require(
            buffer < longest,
            f"{n}.algorithm.overlong_buffer_length",
            buffer,
            f"be < rollout.sampling.max_new_tokens ({longest}): a buffer as long as the budget penalizes every "
            "response, however short (0 turns the penalty off)",
        )
        require(
            self.critic == CriticConfig() or self.algorithm.advantage_estimator == "gae",
            f"{n}.critic",
            self.critic,
            "be left unset unless algorithm.advantage_estimator is 'gae' (preset 'ppo'): only GAE reads a "
            f"value model, and {self.algorithm.advantage_estimator!r} advantages would train none",
        )
        require(self.sync_probe_tokens >= 0, f"{n}.sync_probe_tokens", self.sync_probe_tokens, "be >= 0")
        require(self.sync_probe_tolerance > 0, f"{n}.sync_probe_tolerance", self.sync_probe_tolerance, "be > 0")
        require(self.seed >= 0, f"{n}.seed", self.seed, "be >= 0")
        require(self.log_every >= 1, f"{n}.log_every", self.log_every, "be >= 1")
