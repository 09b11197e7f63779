"""Partial rollouts: responses cut short by an abort (a weight sync, a deadline) kept and continued.

A partial Sample has status ABORTED and metadata["partial"] = True: its tokens, log-probs and
loss mask are those generated before the abort. `continue_partials` resubmits prompt + partial
response to an engine (any rollouts.types.InferenceEngine: vLLM, SGLang, in-process) with the
remaining budget (max_new_tokens - tokens so far) and concatenates tokens and log-probs, so every
token keeps the log-prob of the weights that generated it.

Which weights made which tokens: metadata["version_segments"] is a list of [weight_version, length]
runs over the response, in order (lengths sum to the response length). The Sample's own
`weight_version` is the OLDEST version among its segments, so a staleness bound
(`max_staleness`, applied to Sample.weight_version) holds for every token of a continued response.
`token_versions` expands the segments to one version per response token for a per-token correction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import anyio

from rollouts.types import InferenceEngine, LogProbs, LossMask, Sample, SamplingParams, Status, TokenIds

__all__ = [
    "PARTIAL",
    "VERSION_SEGMENTS",
    "continue_partials",
    "continuation_prompt",
    "join_continuation",
    "oldest_version",
    "token_versions",
    "version_segments",
]

PARTIAL = "partial"
VERSION_SEGMENTS = "version_segments"


def version_segments(sample: Sample) -> tuple[tuple[int | None, int], ...]:
    """(weight_version, length) runs over the response; one run of `sample.weight_version` where none
    were recorded. Refuses segments whose lengths do not sum to the response length."""
    raw = sample.metadata.get(VERSION_SEGMENTS)
    if raw is None:
        n = sample.response_length
        return ((sample.weight_version, n),) if n else ()
    segments = tuple((None if v is None else int(v), int(n)) for v, n in raw)
    total = sum(n for _, n in segments)
    if total != sample.response_length or any(n <= 0 for _, n in segments):
        raise ValueError(
            f"metadata[{VERSION_SEGMENTS!r}] = {raw!r:.120} must be positive lengths summing to the "
            f"response length {sample.response_length}"
        )
    return segments


def token_versions(sample: Sample) -> tuple[int | None, ...]:
    """The weight version of each response token (len == response_length)."""
    return tuple(v for v, n in version_segments(sample) for _ in range(n))


def oldest_version(sample: Sample) -> int | None:
    """The oldest weight version any response token came from; None where none is known."""
    known = [v for v, _ in version_segments(sample) if v is not None]
    return min(known) if known else sample.weight_version


def continuation_prompt(partial: Sample, max_new_tokens: int) -> tuple[tuple[int, ...], int]:
    """(prompt + partial response, remaining token budget) to resubmit `partial`."""
    if not partial.metadata.get(PARTIAL):
        raise ValueError(f"sample is not partial (metadata[{PARTIAL!r}] unset, status {partial.status.value})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    remaining = max_new_tokens - partial.response_length
    if remaining < 0:
        raise ValueError(f"partial response has {partial.response_length} tokens, over max_new_tokens={max_new_tokens}")
    return tuple(partial.tokens), remaining


def _merge_segments(
    first: Sequence[tuple[int | None, int]], second: Sequence[tuple[int | None, int]]
) -> list[list[Any]]:
    out: list[list[Any]] = [[v, n] for v, n in first]
    for v, n in second:
        if out and out[-1][0] == v:
            out[-1][1] += n
        else:
            out.append([v, n])
    return out


def join_continuation(partial: Sample, continuation: Sample) -> Sample:
    """`partial` extended by `continuation`, a Sample whose prompt is partial's tokens (prompt +
    partial response) and whose response is the newly generated tokens. Tokens, log-probs, the
    loss mask and the response text are concatenated; version segments merged; weight_version is
    the oldest; status and partiality are the continuation's."""
    if tuple(continuation.prompt_tokens) != tuple(partial.tokens):
        raise ValueError(
            f"continuation prompt ({continuation.num_prompt_tokens} tokens) is not the partial sample's "
            f"prompt + response ({len(partial.tokens)} tokens)"
        )
    has_lp = (partial.rollout_logprobs is None, continuation.rollout_logprobs is None)
    if has_lp[0] != has_lp[1]:
        raise ValueError("partial and continuation must both carry rollout log-probs or neither")
    new = continuation.response_tokens
    logprobs = None
    if partial.rollout_logprobs is not None and continuation.rollout_logprobs is not None:
        logprobs = LogProbs(
            (*partial.rollout_logprobs, *continuation.rollout_logprobs), what="continued rollout log-probs"
        )
    segments = _merge_segments(version_segments(partial), version_segments(continuation))
    metadata = {k: v for k, v in partial.metadata.items() if k not in (PARTIAL, VERSION_SEGMENTS)}
    metadata |= {k: v for k, v in continuation.metadata.items() if k != VERSION_SEGMENTS}
    metadata[VERSION_SEGMENTS] = segments
    metadata["num_continuations"] = int(partial.metadata.get("num_continuations", 0)) + 1
    if not continuation.metadata.get(PARTIAL):
        metadata.pop(PARTIAL, None)
    known = [v for v, _ in segments if v is not None]
    return replace(
        partial,
        tokens=TokenIds((*partial.tokens, *new), what="continued token ids"),
        response=partial.response + continuation.response,
        loss_mask=LossMask((*partial.loss_mask, *tuple(continuation.loss_mask)[continuation.num_prompt_tokens :])),
        rollout_logprobs=logprobs,
        weight_version=min(known) if known else None,
        status=continuation.status,
        metadata=metadata,
    )


async def continue_partials(
    engine: InferenceEngine, partials: Sequence[Sample], params: SamplingParams
) -> list[Sample]:
    """Continue each partial Sample on `engine` (n=1 each, the remaining budget of
    `params.max_new_tokens`); a partial already at its budget comes back TRUNCATED as it is.
    A continuation aborted again comes back partial, to be continued later. Partials with different
    remaining budgets go out as concurrent calls (one per budget), so the whole takes as long as
    the longest, not the sum."""
    if params.n != 1:
        raise ValueError(f"continuing partial samples takes params.n=1 (one continuation each), got n={params.n}")
    out: list[Sample | None] = [None] * len(partials)
    by_budget: dict[int, list[int]] = {}
    for i, s in enumerate(partials):
        _, remaining = continuation_prompt(s, params.max_new_tokens)
        if remaining == 0:
            meta = {k: v for k, v in s.metadata.items() if k != PARTIAL}
            out[i] = replace(s, status=Status.TRUNCATED, metadata=meta)
        else:
            by_budget.setdefault(remaining, []).append(i)

    async def run(remaining: int, idx: list[int]) -> None:
        got = await engine.generate([list(partials[i].tokens) for i in idx], replace(params, max_new_tokens=remaining))
        if len(got) != len(idx):
            raise RuntimeError(f"engine returned {len(got)} samples for {len(idx)} continuations")
        for i, c in zip(idx, got, strict=True):
            out[i] = join_continuation(partials[i], c)

    async with anyio.create_task_group() as tg:  # one call per budget, all at once: a group takes its longest
        for remaining, idx in sorted(by_budget.items()):
            tg.start_soon(run, remaining, idx)
    return [s for s in out if s is not None]
