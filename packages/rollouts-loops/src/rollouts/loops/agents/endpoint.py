"""The agent endpoint: OpenAI-compatible chat and text completions in front of any InferenceEngine,
one base URL per episode (`http://127.0.0.1:PORT/ep/<id>/v1`), every turn recorded.

    async with serve_agent_endpoint(engine, tokenizer, sampling) as endpoint:
        episode = endpoint.open_episode(index=0, seed=None)
        ...  # an agent's OpenAI client talks to episode.base_url
        samples = endpoint.close_episode(episode).samples(...)

The run's SamplingParams are the defaults and the bounds of every request: `max_tokens` is capped at
the run's max_new_tokens and at what is left of the episode's `max_total_tokens`; `temperature` and
`top_p` may only repeat the run's (wire.py says why). Each turn's seed comes from the group's seed,
the episode's index, the turn's index and the request's own seed (episode.turn_seed). A stop string
that is one token stops the engine there; a longer one cuts the response after the token that
completes it (the tokens kept are still exactly those sampled). An episode's requests are served
one at a time, in the order they arrive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from rollouts.data.user_code import user_error_text
from rollouts.loops.agents.episode import Turn, cut_segments, episode_samples, next_prompt_ids, turn_seed
from rollouts.loops.agents.server import ServerLimits, serve_http
from rollouts.loops.agents.wire import (
    BadRequest,
    TurnRequest,
    TurnResult,
    chat_response,
    completion_response,
    error_body,
    parse_request,
    pieces_of,
)
from rollouts.sync.partial import version_segments
from rollouts.types import InferenceEngine, Sample, SamplingParams, Status

__all__ = ["AgentEndpoint", "EndpointLimits", "Episode", "serve_agent_endpoint"]

_ROUTES = {"chat/completions": "chat", "completions": "completion"}


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointLimits:
    """Bounds on each episode and each request."""

    max_turns: int = 16
    """Requests one episode may make; the next is refused (400)."""
    max_total_tokens: int = 4096
    """Tokens of an episode's context (prompt and everything after); a request past it is refused (400)."""
    request_timeout_s: float = 120.0
    """Bound on one engine call; past it the request fails (504) and so does the episode. With
    rl.rollout.partial a call a weight sync cuts short waits for the sync and is continued after
    it, within this bound."""
    server: ServerLimits = dataclasses.field(default_factory=ServerLimits)

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 2:
            raise ValueError(
                f"max_turns must be >= 1 and max_total_tokens >= 2, got {self.max_turns}, {self.max_total_tokens}"
            )
        if not (math.isfinite(self.request_timeout_s) and self.request_timeout_s > 0):
            raise ValueError(
                f"request_timeout_s must be a finite number of seconds > 0, got {self.request_timeout_s!r}"
            )


@dataclass(slots=True, eq=False)
class Episode:
    """One episode's record: its turns in order, and the first engine failure, if any."""

    episode_id: str
    index: int
    """The episode's position in its group (a part of each turn's seed)."""
    seed: int | None
    """The group's seed (None: unseeded)."""
    base_url: str
    turns: list[Turn] = dataclasses.field(default_factory=list)
    error: str | None = None
    """An engine failure the agent was answered with (its episode cannot become a sample)."""
    transcript: tuple[Any, ...] = ()
    """The last chat request's messages and the reply to it."""
    lock: trio.Lock = dataclasses.field(default_factory=trio.Lock)

    def samples(self, *, decode: Callable[[Sequence[int]], str], metadata: dict[str, Any]) -> list[Sample]:
        """The episode's Samples (episode.episode_samples), with the transcript in metadata."""
        extra = {"transcript": list(self.transcript)} if self.transcript else {}
        return episode_samples(self.turns, episode_id=self.episode_id, decode=decode, metadata={**metadata, **extra})


class AgentEndpoint:
    """The routes and episodes of one server (see the module docstring); `handle` is its Handler."""

    def __init__(
        self, engine: InferenceEngine, tokenizer: Any, sampling: SamplingParams, limits: EndpointLimits
    ) -> None:
        self._engine, self._tokenizer, self._sampling, self._limits = engine, tokenizer, sampling, limits
        self._episodes: dict[str, Episode] = {}
        self.port = 0

    def open_episode(self, *, index: int, seed: int | None) -> Episode:
        """A new episode with its own base URL."""
        episode_id = uuid.uuid4().hex[:16]
        base_url = f"http://127.0.0.1:{self.port}/ep/{episode_id}/v1"
        episode = self._episodes[episode_id] = Episode(episode_id=episode_id, index=index, seed=seed, base_url=base_url)
        return episode

    def close_episode(self, episode: Episode) -> Episode:
        """Stop serving `episode` (its URL answers 404 from now on) and return its record."""
        return self._episodes.pop(episode.episode_id, episode)

    async def handle(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        """One HTTP request: (status, JSON body)."""
        parts = path.split("?", 1)[0].strip("/").split("/", 3)
        if len(parts) < 4 or parts[0] != "ep" or parts[2] != "v1":
            return 404, error_body(f"no route {path!r}: use the episode's base URL, .../ep/<id>/v1", status=404)
        episode = self._episodes.get(parts[1])
        if episode is None:
            return 404, error_body(f"episode {parts[1]!r} is not open (ended, or never started)", status=404)
        if parts[3] == "models" and method == "GET":
            return 200, {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "rollouts"}]}
        kind = _ROUTES.get(parts[3])
        if kind is None:
            return 404, error_body(f"no route {parts[3]!r}: this endpoint serves {sorted(_ROUTES)}", status=404)
        if method != "POST":
            return 405, error_body(f"{parts[3]} takes POST, got {method}", status=405)
        try:
            request = parse_request(kind, json.loads(body or b"null"))  # type: ignore[arg-type]
            async with episode.lock:
                return 200, await self._turn(episode, request)
        except json.JSONDecodeError as e:
            return 400, error_body(f"the request body is not JSON: {e}", status=400)
        except BadRequest as e:
            return e.status, error_body(str(e), status=e.status, param=e.param)
        except trio.TooSlowError:
            episode.error = f"engine {self._engine.name} took longer than {self._limits.request_timeout_s} s"
            return 504, error_body(episode.error, status=504)
        except Exception as e:  # the engine failed: the agent is told, and so is the run (episode.error)
            episode.error = f"engine {self._engine.name} failed: {user_error_text(e)}"
            return 502, error_body(episode.error, status=502)

    async def _turn(self, episode: Episode, request: TurnRequest) -> dict[str, Any]:
        """Serve one request of `episode`: prompt ids, sampling, the engine call, the record."""
        limits, previous = self._limits, episode.turns[-1] if episode.turns else None
        if len(episode.turns) >= limits.max_turns:
            raise BadRequest(f"the episode has made its {limits.max_turns} requests (agent max_turns)")
        prompt_ids, prompt_text = self._prompt(request, previous)
        room = limits.max_total_tokens - len(prompt_ids)
        if room < 1:
            raise BadRequest(
                f"the episode's context is {len(prompt_ids)} tokens, at its limit of {limits.max_total_tokens} "
                "(agent max_total_tokens)",
                param="messages" if request.kind == "chat" else "prompt",
            )
        params, stop_texts = self._params(request, episode, room)
        with trio.fail_after(limits.request_timeout_s):
            (sample,) = await self._engine.generate([list(prompt_ids)], params)
        sampled, logprobs, status = tuple(sample.response_tokens), sample.rollout_logprobs, sample.status
        segments = version_segments(sample)  # two runs where a sync cut the turn short (rollouts.continued)
        text = _reply_text(self._tokenizer, sampled, status, params.stop_token_ids)
        cut = _stop_cut(self._tokenizer, sampled, text, stop_texts)
        if cut is not None:
            sampled, text, status = sampled[: cut[0]], cut[1], Status.COMPLETED
        turn = Turn(
            prompt_ids=prompt_ids,
            sampled_ids=sampled,
            logprobs=tuple(logprobs)[: len(sampled)] if logprobs is not None else None,
            weight_version=sample.weight_version,
            status=status,
            context_text=prompt_text + self._tokenizer.decode(list(sampled), skip_special_tokens=False),
            segments=cut_segments(segments, len(sampled)) if len(segments) > 1 else None,
        )
        episode.turns.append(turn)
        result = TurnResult(
            text=text,
            pieces=pieces_of(self._tokenizer, sampled),
            logprobs=turn.logprobs if turn.logprobs is not None else (0.0,) * len(sampled),
            finish_reason="length" if status is Status.TRUNCATED else "stop",
            num_prompt_tokens=len(prompt_ids),
        )
        response_id = f"{episode.episode_id}-{len(episode.turns)}"
        if request.kind == "chat":
            episode.transcript = (*request.messages, {"role": "assistant", "content": text})
            return chat_response(request, result, response_id=response_id)
        return completion_response(request, result, response_id=response_id)

    def _prompt(self, request: TurnRequest, previous: Turn | None) -> tuple[tuple[int, ...], str]:
        """(prompt ids, prompt text): continuing `previous`'s ids where the text extends them."""
        tokenizer = self._tokenizer

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        if request.kind == "chat":
            try:
                text = tokenizer.apply_chat_template(list(request.messages), tokenize=False, add_generation_prompt=True)
            except Exception as e:  # a template that refuses the messages (a role it does not know, ...)
                raise BadRequest(
                    f"the chat template refused the messages: {user_error_text(e)}", param="messages"
                ) from e
        elif isinstance(request.prompt, str):
            text = request.prompt
        else:
            ids = request.prompt
            vocab = len(tokenizer)
            if max(ids) >= vocab:
                raise BadRequest(f"prompt token id {max(ids)} is outside the vocabulary of {vocab}", param="prompt")
            return ids, tokenizer.decode(list(ids), skip_special_tokens=False)
        return next_prompt_ids(previous, text, encode), text

    def _params(self, request: TurnRequest, episode: Episode, room: int) -> tuple[SamplingParams, tuple[str, ...]]:
        """The turn's SamplingParams and the stop strings applied to the text afterwards."""
        run = self._sampling
        for name, value in (("temperature", request.temperature), ("top_p", request.top_p)):
            if value is not None and value != getattr(run, name):
                raise BadRequest(
                    f"{name}={value} differs from the run's {name}={getattr(run, name)}: the trainer computes "
                    f"log-probs of the run's sampling distribution; leave {name} unset or send the run's",
                    param=name,
                )
        stop_ids, stop_texts = list(run.stop_token_ids), []
        for stop in request.stop:
            ids = self._tokenizer.encode(stop, add_special_tokens=False)
            if len(ids) == 1:
                stop_ids.append(ids[0])
            else:
                stop_texts.append(stop)
        params = dataclasses.replace(
            run,
            n=1,
            max_new_tokens=min(request.max_tokens or run.max_new_tokens, run.max_new_tokens, room),
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            seed=turn_seed(run.seed, episode.index, len(episode.turns), request.seed),
            logprobs=True,  # training needs them whatever the agent asked
        )
        return params, tuple(stop_texts)


def _reply_text(tokenizer: Any, sampled: Sequence[int], status: Status, stop_ids: Sequence[int]) -> str:
    """The reply's text: special tokens kept (a chat template renders them back as they were), but
    not the stop token that ended it (the template writes its own end of turn)."""
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(stop_ids)
    ends = status is Status.COMPLETED and bool(sampled) and sampled[-1] in special
    return str(tokenizer.decode(list(sampled[:-1] if ends else sampled), skip_special_tokens=False))


def _stop_cut(tokenizer: Any, sampled: Sequence[int], text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(ids kept, text before the stop) at the first stop string in `text`; None where none occurs.
    The ids kept run to the token that completes the stop string."""
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    at, stop = min(found)
    for k in range(1, len(sampled) + 1):
        if len(tokenizer.decode(list(sampled[:k]), skip_special_tokens=False)) >= at + len(stop):
            return k, text[:at]
    return len(sampled), text[:at]


@contextlib.asynccontextmanager
async def serve_agent_endpoint(
    engine: InferenceEngine, tokenizer: Any, sampling: SamplingParams, limits: EndpointLimits | None = None
) -> AsyncIterator[AgentEndpoint]:
    """An AgentEndpoint served on 127.0.0.1 at a free port while the block runs."""
    limits = limits if limits is not None else EndpointLimits()
    endpoint = AgentEndpoint(engine, tokenizer, sampling, limits)
    async with trio.open_nursery() as nursery:
        endpoint.port = await nursery.start(serve_http, endpoint.handle, limits.server)
        try:
            yield endpoint
        finally:
            nursery.cancel_scope.cancel()
