"""A reward model served by vLLM (a sequence-classification model, one label, started with
`--runner pooling`): token ids in, one score per sequence out, through vLLM's /classify endpoint
with the activation off (the raw logit, as the model's own forward gives it).

Every request is bounded by `timeout_s` and retried at most `max_retries` times (rollouts.sync's
retry policy); a malformed answer is an EngineError naming the server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rollouts.sync._http import EngineError, HTTPEngineBase, HTTPOptions, RetryPolicy

__all__ = ["VLLMRewardModel"]

CLASSIFY_PATH = "/classify"


class VLLMRewardModel(HTTPEngineBase):
    """Scores of a one-label classification model on a vLLM server (`score(token_ids) -> floats`)."""

    WEIGHT_VERSION_PATH = "/get_world_size"  # unused: a reward model's weights are not synced
    HEALTH_PATH = "/health"

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        max_connections: int = 8,
        max_batch: int = 64,
        retry: RetryPolicy | None = None,
    ) -> None:
        retry = retry if retry is not None else RetryPolicy(max_retries=max_retries)
        http = HTTPOptions(timeout_s=timeout_s, retry=retry, max_connections=max_connections)
        super().__init__(base_url, api_key=api_key, http=http)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self._model = model
        self._max_batch = max_batch

    async def score(self, inputs: Sequence[Sequence[int]]) -> list[float]:
        """One score per sequence of token ids, in order (requests of at most `max_batch`)."""
        for i, ids in enumerate(inputs):
            if isinstance(ids, (str, bytes)) or len(ids) == 0:
                raise ValueError(f"inputs[{i}] must be a non-empty sequence of token ids, got {ids!r:.40}")
        scores: list[float] = []
        for start in range(0, len(inputs), self._max_batch):
            chunk = [list(map(int, ids)) for ids in inputs[start : start + self._max_batch]]
            body: dict[str, Any] = {"input": chunk, "use_activation": False}
            if self._model is not None:
                body["model"] = self._model
            data = (await self._call("POST", CLASSIFY_PATH, json=body)).json()
            scores += self._parse(data, len(chunk))
        return scores

    def _parse(self, data: Any, count: int) -> list[float]:
        rows = data.get("data") if isinstance(data, dict) else None
        if not isinstance(rows, list) or len(rows) != count:
            raise self._bad(f"expected {count} results in 'data', got {data!r:.200}")
        out: list[float | None] = [None] * count
        for row in rows:
            probs = row.get("probs") if isinstance(row, dict) else None
            index = row.get("index") if isinstance(row, dict) else None
            if not isinstance(index, int) or not 0 <= index < count or not isinstance(probs, list):
                raise self._bad(f"a result without a valid index and probs: {row!r:.200}")
            if len(probs) != 1:
                raise self._bad(
                    f"a reward model has one label, this one answered {len(probs)} classes: serve a "
                    "*ForSequenceClassification model with num_labels = 1"
                )
            value = float(probs[0])
            if not math.isfinite(value):
                raise self._bad(f"a non-finite score {value!r}")
            out[index] = value
        if any(v is None for v in out):
            raise self._bad("results with repeated indices")
        return [float(v) for v in out if v is not None]

    def _bad(self, what: str) -> EngineError:
        return EngineError(
            f"{self.name}: {CLASSIFY_PATH}: {what}",
            engine=self.name,
            url=self.name + CLASSIFY_PATH,
            status=None,
            text="",
        )
