"""Protocols: what the packages expect of engines, loggers, tokenizers and user callbacks.

Engines are async (trio): a loop awaits the in-process sampler and a remote vLLM/SGLang server
the same way.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rollouts.types.configs import SamplingParams
from rollouts.types.samples import Sample


@runtime_checkable
class InferenceEngine(Protocol):
    """Something that samples responses and can take new weights."""

    @property
    def name(self) -> str:
        """Human-readable id for logs and errors (e.g. the server URL)."""
        ...

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Sample]:
        """Sample `params.n` responses per prompt (token ids); prompt-major order, n per prompt.

        Each Sample has tokens = prompt + response, num_prompt_tokens, loss_mask 1.0 on the
        response, rollout_logprobs when `params.logprobs`, weight_version and status completed
        or truncated.
        """
        ...

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        """Load HF-format weights from checkpoint directory `path` and record `weight_version`."""
        ...

    async def weight_version(self) -> int | None:
        """The weight version the engine serves now (None if it never got one)."""
        ...

    async def health(self) -> bool:
        """Whether the engine answers generate requests now."""
        ...


@runtime_checkable
class SyncSampler(Protocol):
    """An engine whose sampling is a blocking call (the in-process sampler, the engine process's
    client): what a caller runs in a worker thread of its own (rollouts.loops' CoalescingEngine)."""

    @property
    def name(self) -> str:
        """Human-readable id for logs and errors."""
        ...

    def sample(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int | None] | None = None
    ) -> list[Sample]:
        """What `InferenceEngine.generate` answers, in the calling thread. `seeds`: one per prompt
        (`params.seed` is then ignored), each prompt sampling what it samples alone with its seed,
        so independently seeded requests may share one call."""
        ...


@runtime_checkable
class Abortable(Protocol):
    """An engine that can cut its generations in progress short (they come back as partial Samples:
    status ABORTED, metadata["partial"]) and let them run to the end again. Any thread may call both."""

    def abort(self) -> None:
        """Cut generations in progress (and any started before `resume` or a weight update) short."""
        ...

    def resume(self) -> None:
        """Let generations run to the end again."""
        ...


@runtime_checkable
class WeightLoader(Protocol):
    """An engine that takes a model's tensors directly (no export to disk): the in-process
    engine with a copy of its own, the engine process."""

    async def load_weights(self, tensors: Mapping[str, Any], weight_version: int) -> None:
        """Load HF-named full weights (torch tensors; tied ones may be absent) and serve them as
        `weight_version`; the caller may change `tensors` once it returns."""
        ...


@runtime_checkable
class MetricsLogger(Protocol):
    """Receives one step's scalar metrics at a time."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record `metrics` for `step`."""
        ...

    def close(self) -> None:
        """Flush and release resources; the logger is not used afterwards."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """The subset of a transformers tokenizer that the library uses."""

    eos_token_id: int | None
    pad_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Token ids of `text`."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str:
        """Text of `token_ids`."""
        ...

    def apply_chat_template(
        self, conversation: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]], **kwargs: Any
    ) -> Any:
        """Render chat messages (or a batch of conversations) with the tokenizer's template
        (tokenize=True gives ids)."""
        ...


RewardFn = Callable[[Sample, Any], "float | Awaitable[float]"]
"""Scores one finished sample: reward(sample, record) -> float (sync or async), where `record` is the
prompt record the sample answers (its reference answer, tests, ...)."""

BatchedRewardFn = Callable[[Sequence[Sample], Sequence[Any]], "Sequence[float] | Awaitable[Sequence[float]]"]
"""Scores a whole group in one call: reward(samples, records) -> one float per sample (sync or async)."""

FilterFn = Callable[[Sequence[Sample]], "str | None"]
"""Judges one group of samples: None keeps it, a string is the reason it was dropped."""

GenerateFn = Callable[[Any, int], "Sequence[Sample] | Awaitable[Sequence[Sample]]"]
"""Generates one group: (prompt record, samples per prompt) -> that many Samples (sync or async)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvStep:
    """What an Environment answers to one action."""

    observation: str | tuple[int, ...] = ""
    """Text or token ids shown to the model next (masked out of the loss); empty when done."""
    reward: float = 0.0
    """Reward for this step; a trajectory's reward is the sum over its steps."""
    done: bool = False
    """The episode ended: the model gets no further turn."""

    def __post_init__(self) -> None:
        if isinstance(self.observation, (list, tuple)):
            object.__setattr__(self, "observation", tuple(self.observation))
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.observation):
                raise TypeError(
                    f"EnvStep.observation token ids must be non-negative ints, got {self.observation!r:.80}"
                )
        elif not isinstance(self.observation, str):
            raise TypeError(f"EnvStep.observation must be text or token ids, got {type(self.observation).__name__}")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"EnvStep.reward must be a finite number, got {self.reward!r}")
        if not isinstance(self.done, bool):
            raise TypeError(f"EnvStep.done must be a bool, got {type(self.done).__name__}")


@runtime_checkable
class Environment(Protocol):
    """A multi-turn task, run token-in/token-out: the model acts, the environment observes and scores.

    One instance per episode. `reset(record)` returns the first observation (the prompt: text, or token
    ids); each `step(action_text, action_ids)` gets the model's turn and returns an EnvStep. Both may be
    sync or async. Environment tokens are masked out of the loss; the model's tokens keep their
    log-probs per turn.
    """

    def reset(self, record: Any) -> str | Sequence[int] | Awaitable[str | Sequence[int]]: ...

    def step(self, action_text: str, action_ids: Sequence[int]) -> EnvStep | Awaitable[EnvStep]: ...
