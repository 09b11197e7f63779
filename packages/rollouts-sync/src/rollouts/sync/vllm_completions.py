"""vLLM's /v1/completions answers as Samples: token ids, log-probs and how each choice finished.

Legend: P prompts, G samples per prompt, R response tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from rollouts.sync._common import make_sample
from rollouts.sync._http import EngineError
from rollouts.sync.partial import PARTIAL
from rollouts.types import Sample, SamplingParams, Status

_TOKEN_ID_PREFIX = "token_id:"  # vLLM's spelling of tokens when return_tokens_as_token_ids is set


def parse_completion_response(
    data: Mapping[str, Any],
    prompts_P: list[list[int]],
    params: SamplingParams,
    *,
    weight_version: int | None,
    engine: str,
    logprobs_of: str | None = None,
    keep_partial: bool = False,
) -> list[Sample]:
    """[P * G] Samples from a /v1/completions response, ordered by choice index (prompt-major).
    With `keep_partial`, a choice with finish_reason "abort" is a partial Sample (status ABORTED,
    metadata["partial"] = True) holding the tokens and log-probs generated before the abort."""
    choices = sorted(data.get("choices") or [], key=lambda c: c["index"])
    expected = len(prompts_P) * params.n
    if len(choices) != expected:
        raise EngineError(
            f"{engine}: /v1/completions returned {len(choices)} choices, expected {len(prompts_P)} prompts x n={params.n}",
            engine=engine,
            url=f"{engine}/v1/completions",
            status=200,
            text=str(data)[:500],
        )
    samples = []
    for i, choice in enumerate(choices):
        finish = choice.get("finish_reason")
        partial = keep_partial and finish == "abort"
        if finish not in ("stop", "length") and not partial:  # "abort" (a pause in mode abort), "error", or none at all
            raise EngineError(
                f"{engine}: choice {i} ended with finish_reason={finish!r}, not 'stop' or 'length': "
                "a partial response, never to be scored as finished",
                engine=engine,
                url=f"{engine}/v1/completions",
                status=200,
                text=str(choice)[:500],
            )
        prompt = prompts_P[i // params.n]
        response_ids, logprobs_R = _choice_tokens(choice, want_logprobs=params.logprobs, engine=engine)
        samples.append(
            make_sample(
                prompt_ids=prompt,
                response_ids=response_ids,
                logprobs_R=logprobs_R,
                truncated=finish == "length",
                weight_version=weight_version,
                engine=engine,
                logprobs_of=logprobs_of,
            )
        )
        if partial:
            samples[-1] = replace(samples[-1], status=Status.ABORTED, metadata={**samples[-1].metadata, PARTIAL: True})
    return samples


def _choice_tokens(
    choice: Mapping[str, Any], *, want_logprobs: bool, engine: str
) -> tuple[list[int], list[float] | None]:
    logprobs = choice.get("logprobs")
    ids = choice.get("token_ids")
    if logprobs is not None and logprobs.get("tokens") is not None:
        from_logprobs = [_token_id(t, engine=engine) for t in logprobs["tokens"]]
        if ids is not None and list(ids) != from_logprobs:
            raise EngineError(
                f"{engine}: token_ids and logprobs.tokens disagree",
                engine=engine,
                url=f"{engine}/v1/completions",
                status=200,
                text=str(choice)[:500],
            )
        ids = from_logprobs
    if ids is None:
        raise EngineError(
            f"{engine}: a choice carries neither token_ids nor logprobs.tokens",
            engine=engine,
            url=f"{engine}/v1/completions",
            status=200,
            text=str(choice)[:500],
        )
    if not want_logprobs:
        return [int(t) for t in ids], None
    if logprobs is None:
        raise EngineError(
            f"{engine}: logprobs were asked for but the choice has none",
            engine=engine,
            url=f"{engine}/v1/completions",
            status=200,
            text=str(choice)[:500],
        )
    return [int(t) for t in ids], [float(x) for x in logprobs["token_logprobs"]]


def _token_id(token: str, *, engine: str) -> int:
    if not token.startswith(_TOKEN_ID_PREFIX):
        raise EngineError(
            f"{engine}: token {token!r} is not in 'token_id:N' form (return_tokens_as_token_ids ignored?)",
            engine=engine,
            url=f"{engine}/v1/completions",
            status=200,
            text=token,
        )
    return int(token[len(_TOKEN_ID_PREFIX) :])
