"""Protocols: what the packages expect of engines, loggers, tokenizers and user callbacks.

Engines are async (trio): a loop awaits the in-process sampler and a remote vLLM/SGLang server
the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
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

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], **kwargs: Any) -> Any:
        """Render chat messages with the tokenizer's template (tokenize=True gives ids)."""
        ...


RewardFn = Callable[[Sample], float]
"""Scores one finished sample."""

FilterFn = Callable[[Sequence[Sample]], "str | None"]
"""Judges one group of samples: None keeps it, a string is the reason it was dropped."""

GenerateFn = Callable[[Any, int], "Sequence[Sample] | Awaitable[Sequence[Sample]]"]
"""Generates one group: (prompt record, samples per prompt) -> that many Samples (sync or async)."""
