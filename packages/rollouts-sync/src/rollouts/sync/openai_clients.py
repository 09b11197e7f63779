"""Two OpenAI-compatible clients beside the engine clients: the log-probs a served model gives each
token of given sequences (vLLM's `prompt_logprobs` on /v1/completions: a distillation teacher), and
chat completions (/v1/chat/completions: an LLM judge). Any server speaking the OpenAI API answers
the second; the first needs vLLM (or the fake server).

Every request is bounded by `timeout_s` and retried at most `max_retries` times (rollouts.sync's
retry policy: transport errors and 5xx, never a 4xx); a malformed answer is an EngineError naming
the server and what was wrong.

Legend: S sequences, T_i tokens of sequence i.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rollouts.sync._http import EngineError, HTTPEngineBase, HTTPOptions, RetryPolicy

__all__ = ["ChatClient", "PromptLogprobsClient"]

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


class _OpenAIBase(HTTPEngineBase):
    WEIGHT_VERSION_PATH = "/get_world_size"  # unused: these clients never sync weights
    HEALTH_PATH = "/health"

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None,
        api_key: str | None,
        timeout_s: float,
        max_retries: int,
        max_connections: int,
    ) -> None:
        http = HTTPOptions(
            timeout_s=timeout_s, retry=RetryPolicy(max_retries=max_retries), max_connections=max_connections
        )
        super().__init__(base_url, api_key=api_key, http=http)
        self._model = model

    async def model_name(self) -> str:
        """The served model's name: the one given, else the first /v1/models lists (asked once)."""
        if self._model is None:
            data = (await self._call("GET", "/v1/models")).json()
            models = data.get("data") if isinstance(data, dict) else None
            if not models:
                raise self._bad("/v1/models", f"lists no model: {data!r:.200}")
            self._model = str(models[0]["id"])
        return self._model

    def _bad(self, path: str, what: str) -> EngineError:
        return EngineError(f"{self.name}: {path}: {what}", engine=self.name, url=self.name + path, status=None)


class PromptLogprobsClient(_OpenAIBase):
    """Per-token log-probs of token-id sequences under a vLLM server's model (`prompt_logprobs`):
    `sequence_logprobs(sequences) -> [T_i] per sequence`, entry t = log p(token t | tokens < t),
    entry 0 = 0.0 (nothing predicts the first token). The model's own distribution: vLLM reports
    prompt log-probs before any temperature or truncation."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        max_connections: int = 8,
        max_batch: int = 64,
    ) -> None:
        super().__init__(
            base_url,
            model=model,
            api_key=api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
            max_connections=max_connections,
        )
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self._max_batch = max_batch

    async def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """[T_i] log-probs per sequence, in order (requests of at most `max_batch` sequences)."""
        for i, ids in enumerate(sequences):
            if isinstance(ids, (str, bytes)) or len(ids) == 0:
                raise ValueError(f"sequences[{i}] must be a non-empty sequence of token ids, got {ids!r:.40}")
        model = await self.model_name()
        out: list[list[float]] = []
        for start in range(0, len(sequences), self._max_batch):
            chunk = [list(map(int, ids)) for ids in sequences[start : start + self._max_batch]]
            # one token generated (vLLM needs one), greedy; prompt_logprobs=0: each prompt token's own log-prob only
            body = {"model": model, "prompt": chunk, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
            data = (await self._call("POST", COMPLETIONS_PATH, json=body)).json()
            out += self._parse(data, chunk)
        return out

    def _parse(self, data: Any, chunk: list[list[int]]) -> list[list[float]]:
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or len(choices) != len(chunk):
            raise self._bad(COMPLETIONS_PATH, f"expected {len(chunk)} choices, got {data!r:.200}")
        out: list[list[float] | None] = [None] * len(chunk)
        for position, choice in enumerate(choices):
            index = choice.get("index", position) if isinstance(choice, dict) else None
            rows = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
            if not isinstance(index, int) or not 0 <= index < len(chunk) or not isinstance(rows, list):
                raise self._bad(
                    COMPLETIONS_PATH,
                    f"a choice without prompt_logprobs (is this a vLLM server?): {choice!r:.200}",
                )
            out[index] = self._row(rows, chunk[index])
        if any(row is None for row in out):
            raise self._bad(COMPLETIONS_PATH, "choices with repeated indices")
        return [row for row in out if row is not None]

    def _row(self, rows: list[Any], ids: list[int]) -> list[float]:
        if len(rows) != len(ids):
            raise self._bad(COMPLETIONS_PATH, f"{len(rows)} prompt log-probs for a sequence of {len(ids)} tokens")
        values = [0.0]
        for t in range(1, len(ids)):
            entry = rows[t].get(str(ids[t])) if isinstance(rows[t], Mapping) else None
            value = entry.get("logprob") if isinstance(entry, Mapping) else None
            if not isinstance(value, (int, float)) or math.isnan(value):
                raise self._bad(COMPLETIONS_PATH, f"no log-prob of token {ids[t]} at position {t}: {rows[t]!r:.200}")
            values.append(float(value))
        return values


class ChatClient(_OpenAIBase):
    """Chat completions from any OpenAI-compatible server: `complete(messages) -> the reply's text`."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        max_connections: int = 16,
    ) -> None:
        super().__init__(
            base_url,
            model=model,
            api_key=api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
            max_connections=max_connections,
        )

    async def complete(
        self, messages: Sequence[Mapping[str, str]], *, max_tokens: int = 256, temperature: float = 0.0
    ) -> str:
        """The text of the first choice's message (one request, bounded and retried)."""
        body = {
            "model": await self.model_name(),
            "messages": [dict(m) for m in messages],
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        data = (await self._call("POST", CHAT_PATH, json=body)).json()
        choices = data.get("choices") if isinstance(data, dict) else None
        message = choices[0].get("message") if isinstance(choices, list) and choices else None
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            raise self._bad(CHAT_PATH, f"no choices[0].message.content in {data!r:.200}")
        return content
