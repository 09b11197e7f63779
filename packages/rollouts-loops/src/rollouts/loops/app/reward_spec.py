"""The [reward] section of an RL run file: a verifier (built-in or by import path) and learned
reward models ([[reward.models]]), each weighted."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from rollouts.types import check_fields, require

BUILTIN_REWARDS = ("math_answer", "exact_match", "environment")


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardModelSpec:
    """A learned reward model ([[reward.models]]): a one-label *ForSequenceClassification model, in
    this process (`path`) or on a vLLM server started with --runner pooling (`url`)."""

    path: str = ""
    """Local HF directory of the reward model (scored in process, batched, no grad)."""
    url: str = ""
    """Base URL of a vLLM server serving it (its /classify endpoint)."""
    weight: float = 1.0
    """Its score's weight in the reward (the verifier's is reward.weight)."""
    encode: Literal["policy_tokens", "chat"] = "policy_tokens"
    """What it reads: the sample's own token ids (a reward model sharing the policy's tokenizer), or
    prompt and response rendered by its own tokenizer's chat template ("chat": tokenizer from
    `tokenizer_path`, else `path`)."""
    tokenizer_path: str = ""
    """The reward model's tokenizer ("chat"); for a `url` model also where its pad id is read (config.json,
    else the tokenizer), whose trailing copies are dropped so the server scores the last non-pad token."""
    batch_size: int = 16
    timeout_s: float = 120.0
    """Bound on scoring one group."""

    def __post_init__(self) -> None:
        check_fields(self)
        n = "RewardModelSpec"
        require(bool(self.path) != bool(self.url), f"{n}.path", self.path, f"be set, or url ({self.url!r}), not both")
        require(math.isfinite(self.weight), f"{n}.weight", self.weight, "be a finite number")
        require(
            self.encode != "chat" or bool(self.tokenizer_path or self.path),
            f"{n}.tokenizer_path",
            self.tokenizer_path,
            "be set when encode is 'chat' for a model served at a url",
        )
        require(self.batch_size >= 1, f"{n}.batch_size", self.batch_size, "be >= 1")
        require(self.timeout_s > 0, f"{n}.timeout_s", self.timeout_s, "be > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardSpec:
    """The RL reward: a built-in name or an import path ("pkg.module:name", "path/to/file.py:name"),
    weighted and summed with any reward models."""

    fn: str = "math_answer"
    """'math_answer' (math-verify grading against the answer field), 'exact_match', or an import path
    of reward(sample, record) -> float (sync or async) or, with `batched`, reward(samples, records)."""
    batched: bool = False
    on_error: Literal["raise", "zero"] = "raise"
    """What a reward that raises or returns a non-finite value does: stop the run, or score 0 (counted)."""
    timeout_s: float = 60.0
    """Bound on one reward call."""
    max_threads: int = 40
    """Worker threads for sync reward calls, apart from the loop's own: a call abandoned at
    timeout_s keeps its thread, and once every thread is held so, new calls fail at once."""
    weight: float = 1.0
    """The weight of `fn`'s reward when reward models are added (0: the reward models alone)."""
    models: tuple[RewardModelSpec, ...] = ()
    """Learned reward models ([[reward.models]] tables), each weighted and added to `fn`'s reward."""

    def __post_init__(self) -> None:
        check_fields(self)
        require(bool(self.fn), "RewardSpec.fn", self.fn, f"be one of {list(BUILTIN_REWARDS)} or an import path")
        require(self.timeout_s > 0, "RewardSpec.timeout_s", self.timeout_s, "be > 0")
        require(self.max_threads >= 1, "RewardSpec.max_threads", self.max_threads, "be >= 1")
        require(math.isfinite(self.weight), "RewardSpec.weight", self.weight, "be a finite number")
