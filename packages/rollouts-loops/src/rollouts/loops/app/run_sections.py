"""The RL run file's [distill] section and [reward.judge] table: on-policy distillation from a
teacher, and an LLM judge as the reward (`reward.fn = "judge"`). Checked as the rest of the file is."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from rollouts.types import check_fields, require


def _url_ok(url: str) -> bool:
    return url.startswith(("http://", "https://"))


@dataclass(frozen=True, slots=True, kw_only=True)
class DistillSpec:
    """On-policy distillation ([distill]): each sampled token's advantage is coef * (teacher log-prob -
    student log-prob) (`estimate = "sampled"`), or the divergence between the student's and the
    teacher's whole next-token distributions at each sampled position joins the loss, coef times its
    token-mean (`estimate = "full"`, a teacher at `path` only); either replaces the task reward's
    advantage or is added to it. Off while neither `path` nor `url` is set."""

    path: str = ""
    """The teacher: a local HF model directory, run in the trainer's process (frozen, on every rank).
    With `url`: the served model's directory, read for the vocabulary check only."""
    url: str = ""
    """The teacher on a vLLM server (its prompt log-probs, /v1/completions)."""
    model: str = ""
    """The served model's name (empty: the first /v1/models lists)."""
    api_key_env: str = ""
    """Name of the environment variable holding the server's API key (never the key itself)."""
    coef: float = 1.0
    mode: Literal["replace", "add"] = "replace"
    """"replace": the distillation term alone trains (the reward is still logged); "add": added to the reward's advantage."""
    estimate: Literal["sampled", "full"] = "sampled"
    """"sampled": the sampled token's log-prob gap as its advantage (any teacher); "full": the
    divergence over the whole vocabulary (far fewer samples to learn; needs the teacher at `path`)."""
    beta: float = 1.0
    """With estimate = "full": 1 reverse KL, 0 forward KL, between GKD's generalized JSD."""
    timeout_s: float = 120.0
    """Bound on one request to the teacher's server."""
    max_retries: int = 3

    def __post_init__(self) -> None:
        check_fields(self)
        n = "DistillSpec"
        require(self.estimate in ("sampled", "full"), f"{n}.estimate", self.estimate, "be 'sampled' or 'full'")
        require(0.0 <= self.beta <= 1.0, f"{n}.beta", self.beta, "be in [0, 1] (1: reverse KL, 0: forward KL)")
        require(
            self.estimate == "full" or self.beta == 1.0,
            f"{n}.beta",
            self.beta,
            "be 1 unless estimate = 'full' (a sampled token estimates the reverse KL only)",
        )
        require(
            not (self.url and self.estimate == "full"),
            f"{n}.estimate",
            self.estimate,
            "be 'sampled' with a served teacher (url): a server's prompt log-probs are the sampled tokens' only",
        )
        require(not self.url or _url_ok(self.url), f"{n}.url", self.url, "start with http:// or https://")
        require(self.coef > 0, f"{n}.coef", self.coef, "be > 0")
        require(self.timeout_s > 0, f"{n}.timeout_s", self.timeout_s, "be > 0")
        require(self.max_retries >= 0, f"{n}.max_retries", self.max_retries, "be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.url)


@dataclass(frozen=True, slots=True, kw_only=True)
class JudgeLabelSpec:
    """One label a judge may answer ([[reward.judge.labels]]) and its score."""

    label: str
    score: float

    def __post_init__(self) -> None:
        check_fields(self)
        require(bool(self.label.strip()), "JudgeLabelSpec.label", self.label, "be a non-empty word")
        require(math.isfinite(self.score), "JudgeLabelSpec.score", self.score, "be a finite number")


@dataclass(frozen=True, slots=True, kw_only=True)
class JudgeSpec:
    """An LLM judge ([reward.judge], with reward.fn = "judge"): a chat model on an OpenAI-compatible
    server reads `template` filled in with {prompt}, {response} and the record's fields; its reply's
    score (a number in [low, high], normalized to [0, 1], or one of `labels`) is the reward."""

    url: str = ""
    """Base URL of the server (e.g. http://localhost:8000; /v1/chat/completions is added)."""
    model: str = ""
    """The judge model's name (empty: the first /v1/models lists)."""
    api_key_env: str = ""
    """Name of the environment variable holding the API key (never the key itself)."""
    template: str = ""
    """The rubric: str.format fields {prompt}, {response} and the prompt record's fields."""
    system: str = ""
    """An optional system message."""
    low: float = 0.0
    high: float = 10.0
    labels: tuple[JudgeLabelSpec, ...] = ()
    """Labels instead of a number ([[reward.judge.labels]] label = "good", score = 1.0)."""
    pattern: str = ""
    """A regex whose first group is the score's text (empty: the last number or label in the reply)."""
    timeout_s: float = 60.0
    """Bound on one attempt of one judge call."""
    max_retries: int = 2
    max_concurrency: int = 16
    """Judge calls in flight at once, over the whole run."""
    group_timeout_s: float = 600.0
    """Bound on one group's judge calls (waits for a free slot included)."""
    max_tokens: int = 256
    """The longest reply asked for (within the judge server's context length)."""

    def __post_init__(self) -> None:
        check_fields(self)
        n = "JudgeSpec"
        require(not self.url or _url_ok(self.url), f"{n}.url", self.url, "start with http:// or https://")
        require(self.low < self.high, f"{n}.high", self.high, f"be > low ({self.low})")
        require(self.timeout_s > 0, f"{n}.timeout_s", self.timeout_s, "be > 0")
        require(self.max_retries >= 0, f"{n}.max_retries", self.max_retries, "be >= 0")
        require(self.max_concurrency >= 1, f"{n}.max_concurrency", self.max_concurrency, "be >= 1")
        require(self.group_timeout_s > 0, f"{n}.group_timeout_s", self.group_timeout_s, "be > 0")
        require(self.max_tokens >= 1, f"{n}.max_tokens", self.max_tokens, "be >= 1")
        try:
            groups = re.compile(self.pattern).groups if self.pattern else 1
        except re.error as e:
            raise ValueError(f"{n}.pattern must be a regular expression, got {self.pattern!r}: {e}") from e
        require(groups >= 1, f"{n}.pattern", self.pattern, "have a group capturing the score")

    def check_used(self) -> None:
        """The rules that hold once reward.fn = "judge": a server and a rubric that shows the response."""
        require(bool(self.url), "RewardSpec.judge.url", self.url, 'be set when reward.fn = "judge"')
        require(
            "{response}" in self.template,
            "RewardSpec.judge.template",
            self.template,
            "include {response} (the text it judges)",
        )
