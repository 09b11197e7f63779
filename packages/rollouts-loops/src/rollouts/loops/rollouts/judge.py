"""LLM-as-judge rewards: a chat model on an OpenAI-compatible server reads a rubric filled in with
the prompt, the response and the prompt record's fields, and its reply is parsed into a score.

    reward = judge_reward("http://localhost:8000", template="Rate 0-10 how polite this is:\\n{response}")

A batched reward (one call per group): the group's judge calls run concurrently, at most
`max_concurrency` at once across every group of the run; each call is bounded by `timeout_s` per
attempt and retried at most `max_retries` times (rollouts.sync.ChatClient); identical calls
(the same rendered messages) for samples of one weight version (one step's rollouts) are made
once, later ones reading the first one's score. A sample whose call fails, or whose reply holds no
score in bounds, fails alone with its cause (EngineError, JudgeParseError, ...), counted by cause
in the step's metrics as every reward error is (rollouts.loops.rollouts.scoring).

A reply's score (`JudgeScale`): with labels, the label the reply names (the last one it names),
mapped to its score; else the last number in the reply, in [low, high], normalized to [0, 1].
A `pattern` (a regex with one group) picks the score's text out of the reply instead.
"""

from __future__ import annotations

import math
import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from rollouts.loops.rollouts.scoring import OnError, Reward
from rollouts.sync import ChatClient
from rollouts.types import Sample

__all__ = ["JudgeLimits", "JudgeParseError", "JudgeScale", "judge_reward", "parse_score", "render_rubric"]

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_MAX_CACHED_CALLS = 100_000  # a step's distinct judge calls kept at most (a bound, not an expected size)


class JudgeParseError(ValueError):
    """The judge's reply holds no score within the scale."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JudgeScale:
    """How a judge's reply becomes a reward."""

    low: float = 0.0
    high: float = 10.0
    """A number in [low, high] scores (number - low) / (high - low)."""
    labels: Mapping[str, float] = field(default_factory=dict)
    """Label -> score, matched as whole words, case-insensitively (non-empty: numbers are not read)."""
    pattern: str = ""
    """A regex whose first group is the score's text (its last match counts); empty: the whole reply."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"JudgeScale needs finite low < high, got low={self.low!r}, high={self.high!r}")
        for label, score in self.labels.items():
            if not label.strip() or not math.isfinite(score):
                raise ValueError(
                    f"JudgeScale.labels: {label!r} -> {score!r} must be a non-empty label and a finite score"
                )
        if self.pattern and re.compile(self.pattern).groups < 1:
            raise ValueError(f"JudgeScale.pattern {self.pattern!r} must have a group capturing the score")


def parse_score(reply: str, scale: JudgeScale) -> float:
    """The reward a judge's `reply` gives (module docstring); JudgeParseError when it holds none."""
    text = reply
    if scale.pattern:
        matches = re.findall(scale.pattern, reply, flags=re.IGNORECASE | re.DOTALL)
        if not matches:
            raise JudgeParseError("the judge's reply does not match the scale's pattern")
        last = matches[-1]
        text = last[0] if isinstance(last, tuple) else last
    if scale.labels:
        found = [
            (m.start(), label)
            for label in scale.labels
            for m in re.finditer(rf"(?<!\w){re.escape(label)}(?!\w)", text, flags=re.IGNORECASE)
        ]
        if not found:
            raise JudgeParseError(f"the judge's reply names none of the labels {sorted(scale.labels)}")
        return float(scale.labels[max(found)[1]])
    numbers = _NUMBER.findall(text)
    if not numbers:
        raise JudgeParseError("the judge's reply holds no number")
    value = float(numbers[-1])
    if not scale.low <= value <= scale.high:
        raise JudgeParseError(f"the judge's score is outside [{scale.low:g}, {scale.high:g}]")
    return (value - scale.low) / (scale.high - scale.low)


def _prompt_text(sample: Sample) -> str:
    prompt = sample.prompt
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


def render_rubric(template: str, sample: Sample, record: Mapping[str, Any] | Any) -> str:
    """`template` with {prompt}, {response} and the prompt record's fields filled in (str.format;
    double braces for literal ones)."""
    fields = dict(record) if isinstance(record, Mapping) else {}
    fields.update(prompt=_prompt_text(sample), response=sample.response)
    try:
        return template.format_map(fields)
    except KeyError as e:
        raise KeyError(f"the rubric names {{{e.args[0]}}}, which is neither prompt, response nor a record field") from e


def _check_template(template: str) -> None:
    names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    if "response" not in names:
        raise ValueError(f"a judge's rubric must include {{response}} (the text it judges), got {template!r:.200}")


@dataclass(slots=True, eq=False)
class _Call:
    done: trio.Event
    result: float | Exception | None = None


@dataclass(slots=True, eq=False)
class _Judge:
    """One judge's state across calls: the weight version cached, its calls, the per-loop client."""

    url: str
    client_options: dict[str, Any]
    template: str
    system: str
    scale: JudgeScale
    max_concurrency: int
    max_tokens: int
    version: int | None = None
    calls: dict[tuple[Any, ...], _Call] = field(default_factory=dict)
    loop: object = None
    client: ChatClient | None = None
    slots: trio.Semaphore | None = None

    def _session(self) -> tuple[ChatClient, trio.Semaphore]:
        """The HTTP client and concurrency bound of the running event loop (a new loop gets its own)."""
        token = trio.lowlevel.current_trio_token()
        if self.loop is not token or self.client is None or self.slots is None:
            self.loop, self.calls = token, {}
            self.client = ChatClient(self.url, **self.client_options)
            self.slots = trio.Semaphore(self.max_concurrency)
        return self.client, self.slots

    def _cached(self, key: tuple[Any, ...]) -> tuple[_Call, bool]:
        """The call for `key` (weight version, messages) and whether this caller makes it; a newer
        weight version (the next step's rollouts) drops the older versions' calls."""
        version = key[0]
        if version is not None and (self.version is None or version > self.version):
            self.version = version
            self.calls = {k: c for k, c in self.calls.items() if k[0] is None or k[0] >= version}
        if key in self.calls:
            return self.calls[key], False
        if len(self.calls) >= _MAX_CACHED_CALLS:
            self.calls = {}
        call = self.calls[key] = _Call(done=trio.Event())
        return call, True

    async def score(self, sample: Sample, record: Any) -> float | Exception:
        try:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": "user", "content": render_rubric(self.template, sample, record)}
            ]
        except KeyError as e:
            return e
        client, slots = self._session()
        key = (sample.weight_version, *(m["content"] for m in messages))
        call, mine = self._cached(key)
        if not mine:
            await call.done.wait()
            assert call.result is not None
            return call.result
        try:
            async with slots:
                reply = await client.complete(messages, max_tokens=self.max_tokens, temperature=0.0)
            call.result = parse_score(reply, self.scale)
        except Exception as e:
            call.result = e
        finally:
            if call.result is None:  # cancelled: a later identical call asks again
                self.calls.pop(key, None)
                call.result = TimeoutError("the judge call was cancelled (the group's time limit)")
            call.done.set()
        return call.result

    async def __call__(self, samples: Sequence[Sample], records: Sequence[Any]) -> list[float | Exception]:
        results: list[float | Exception] = [0.0] * len(samples)

        async def one(i: int) -> None:
            results[i] = await self.score(samples[i], records[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(samples)):
                nursery.start_soon(one, i)
        return results


@dataclass(frozen=True, slots=True, kw_only=True)
class JudgeLimits:
    """The bounds on a judge's calls."""

    timeout_s: float = 60.0
    """One attempt of one call."""
    max_retries: int = 2
    """Attempts after the first (transport errors and 5xx only)."""
    max_concurrency: int = 16
    """Calls in flight at once, over every group."""
    group_timeout_s: float = 600.0
    """One group's calls, waits for a free slot included."""
    max_tokens: int = 256
    """The longest reply asked for (a server refuses more than its context length)."""

    def __post_init__(self) -> None:
        for name, least in (("max_retries", 0), ("max_concurrency", 1), ("max_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"JudgeLimits.{name} must be an int >= {least}, got {value!r}")
        for name in ("timeout_s", "group_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"JudgeLimits.{name} must be a finite number of seconds > 0, got {value!r}")


def judge_reward(
    url: str,
    *,
    template: str,
    model: str | None = None,
    api_key_env: str = "",
    scale: JudgeScale | None = None,
    system: str = "",
    limits: JudgeLimits | None = None,
    on_error: OnError = "zero",
) -> Reward:
    """A Reward that asks the chat model at `url` (an OpenAI-compatible server) to judge each sample
    with `template` (module docstring). `api_key_env`: the environment variable holding the API key."""
    _check_template(template)
    limits = limits if limits is not None else JudgeLimits()
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ValueError(f"the judge's API key variable {api_key_env} is not set in the environment")
    options: dict[str, Any] = dict(
        model=model,
        api_key=api_key,
        timeout_s=limits.timeout_s,
        max_retries=limits.max_retries,
        max_connections=limits.max_concurrency,
    )
    ChatClient(url, **options)  # a bad URL or option fails here, not at the first step
    judge = _Judge(
        url=url,
        client_options=options,
        template=template,
        system=system,
        scale=scale if scale is not None else JudgeScale(),
        max_concurrency=limits.max_concurrency,
        max_tokens=limits.max_tokens,
    )

    async def judge_group(samples: Sequence[Sample], records: Sequence[Any]) -> list[Any]:
        return await judge(samples, records)  # a failed sample's exception in its place (scoring.py)

    return Reward(fn=judge_group, batched=True, on_error=on_error, timeout_s=limits.group_timeout_s)
