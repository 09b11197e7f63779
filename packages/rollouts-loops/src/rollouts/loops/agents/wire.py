"""The OpenAI wire format of the agent endpoint: requests parsed and checked, responses built.

Pure functions over JSON values. What the endpoint cannot honour is refused with a 4xx naming the
field and the rule (`BadRequest`), never ignored: several choices (`n` > 1), streaming, tool calls
parsed out of the text, logit biases and penalties, top log-probs, and sampling settings other than
the run's (the trainer computes log-probs of the run's sampling distribution: a turn sampled at
another temperature would be trained on with the wrong probabilities).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "BadRequest",
    "TurnRequest",
    "TurnResult",
    "chat_response",
    "completion_response",
    "error_body",
    "parse_request",
    "pieces_of",
]

Kind = Literal["chat", "completion"]

_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "n", "seed", "stream", "user", "logprobs"}
_IGNORED = {"model", "user", "metadata", "store"}  # labels only: they change nothing sampled
_ALLOWED: dict[Kind, frozenset[str]] = {
    "chat": frozenset(_COMMON | _IGNORED | {"messages", "max_completion_tokens", "top_logprobs"}),
    "completion": frozenset(_COMMON | _IGNORED | {"prompt", "echo", "best_of", "suffix"}),
}
_NEUTRAL = {  # fields taken only at the value that changes nothing
    "n": 1,
    "stream": False,
    "top_logprobs": 0,
    "echo": False,
    "best_of": 1,
    "suffix": None,
}
_MAX_STOPS = 4  # as OpenAI's API


class BadRequest(ValueError):
    """A request the endpoint refuses: `status` (4xx) and a message naming the field and the rule."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRequest:
    """One /v1/chat/completions or /v1/completions request, checked."""

    kind: Kind
    messages: tuple[Mapping[str, Any], ...] = ()
    """Chat: the conversation so far (rendered with the tokenizer's chat template)."""
    prompt: str | tuple[int, ...] = ""
    """Completions: the prompt text, or its token ids."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    model: str = ""


def parse_request(kind: Kind, body: Any) -> TurnRequest:
    """`body` (decoded JSON) as a TurnRequest; BadRequest naming the first field that is refused."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _ALLOWED[kind])
    if unknown:
        raise BadRequest(
            f"unsupported field(s) {unknown}: this endpoint takes {sorted(_ALLOWED[kind])}"
            + (
                " (tool calls are not parsed: describe tools in the prompt and read the text)"
                if "tools" in unknown
                else ""
            ),
            param=unknown[0],
        )
    for name, neutral in _NEUTRAL.items():
        if body.get(name, neutral) not in (neutral, None):
            raise BadRequest(f"{name}={body[name]!r} is not supported (only {neutral!r})", param=name)
    max_tokens = _max_tokens(body)
    return TurnRequest(
        kind=kind,
        messages=_messages(body) if kind == "chat" else (),
        prompt=_prompt(body) if kind == "completion" else "",
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", low=0.0, high=2.0),
        top_p=_number(body, "top_p", low=0.0, high=1.0, low_open=True),
        stop=_stops(body.get("stop")),
        seed=_int(body, "seed"),
        logprobs=_logprobs(kind, body.get("logprobs")),
        model=str(body.get("model") or ""),
    )


def _messages(body: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", param="messages")
        if m.get("tool_calls"):
            raise BadRequest(f"messages[{i}] has tool_calls: tool calls are not supported", param="messages")
        out.append({**m, "content": _content(m.get("content"), i)})
    return tuple(out)


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest(f"messages[{i}].content must be text or a list of text parts", param="messages")


def _prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if min(prompt) < 0:
            raise BadRequest("prompt token ids must be >= 0", param="prompt")
        return tuple(prompt)
    raise BadRequest("prompt must be one non-empty string or one list of token ids", param="prompt")


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    values = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    if len(set(values.values())) > 1:
        raise BadRequest(f"max_tokens and max_completion_tokens disagree: {values}", param="max_tokens")
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"{key} must be an integer >= 1, got {value!r}", param=key)
        return value
    return None


def _number(body: Mapping[str, Any], key: str, *, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise BadRequest(f"{key} must be a number in {bounds}, got {value!r}", param=key)
    return float(value)


def _int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"{key} must be an integer, got {value!r}", param=key)
    return value


def _stops(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > _MAX_STOPS:
        raise BadRequest(
            f"stop must be a non-empty string or a list of at most {_MAX_STOPS}, got {stop!r}", param="stop"
        )
    return tuple(stops)


def _logprobs(kind: Kind, value: Any) -> bool:
    if value is None or value is False:
        return False
    if kind == "chat" and value is True:
        return True
    if kind == "completion" and value == 0 and not isinstance(value, bool):
        return True  # the sampled tokens' own log-probs, no alternatives
    want = "true or false" if kind == "chat" else "0 or null (no top alternatives)"
    raise BadRequest(f"logprobs must be {want}, got {value!r}", param="logprobs")


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnResult:
    """What one turn sampled, as the response reports it."""

    text: str
    pieces: tuple[str, ...]
    """One text piece per sampled token (the log-probs' `token` fields)."""
    logprobs: tuple[float, ...]
    finish_reason: Literal["stop", "length"]
    num_prompt_tokens: int


def _usage(result: TurnResult) -> dict[str, int]:
    n = len(result.pieces)
    return {
        "prompt_tokens": result.num_prompt_tokens,
        "completion_tokens": n,
        "total_tokens": result.num_prompt_tokens + n,
    }


def chat_response(request: TurnRequest, result: TurnResult, *, response_id: str) -> dict[str, Any]:
    """The chat.completion object for `result`."""
    logprobs = None
    if request.logprobs:
        content = [
            {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
            for p, lp in zip(result.pieces, result.logprobs, strict=True)
        ]
        logprobs = {"content": content, "refusal": None}
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": result.text},
        "logprobs": logprobs,
        "finish_reason": result.finish_reason,
    }
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [choice],
        "usage": _usage(result),
    }


def completion_response(request: TurnRequest, result: TurnResult, *, response_id: str) -> dict[str, Any]:
    """The text_completion object for `result`."""
    logprobs = None
    if request.logprobs:
        offsets, at = [], 0
        for p in result.pieces:
            offsets.append(at)
            at += len(p)
        logprobs = {
            "tokens": list(result.pieces),
            "token_logprobs": list(result.logprobs),
            "top_logprobs": None,
            "text_offset": offsets,
        }
    choice = {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}
    return {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [choice],
        "usage": _usage(result),
    }


def error_body(message: str, *, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def pieces_of(tokenizer: Any, ids: Sequence[int]) -> tuple[str, ...]:
    """Each token's own text (a token inside a multi-byte character decodes to a replacement mark)."""
    return tuple(tokenizer.decode([i], skip_special_tokens=False) for i in ids)
