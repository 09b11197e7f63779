"""The fake engine server's OpenAI chat completions (a scripted judge) and vLLM prompt log-probs.

A chat request is answered by `FakeEngineState.chat_reply(messages)` (a test's script: any text,
or an exception to answer HTTP 500 with its message), else by `default_reply`: "Score: N" with N
a pseudo-random function of the last message, in 0..10. Prompt log-probs are those of the fake
model (`FakeEngineState.logprobs_V`), in vLLM's shape: None first, then {"<token id>": {...}}.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollouts.sync.fake_http import HTTPError, json_response

if TYPE_CHECKING:
    from rollouts.sync.fake_server import FakeEngineState

ChatReply = Callable[[list[dict[str, Any]]], str]
"""messages -> the reply's text."""


def default_reply(messages: list[dict[str, Any]]) -> str:
    """ "Score: N", N in 0..10 from a checksum of the last message's content."""
    return f"Score: {zlib.crc32(str(messages[-1].get('content', '')).encode()) % 11}"


def chat_completion(state: FakeEngineState, body: dict[str, Any]) -> tuple[int, bytes]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise HTTPError(400, "messages must be a non-empty list of {role, content} objects")
    if body.get("model") != state.model_name:
        raise HTTPError(404, f"The model `{body.get('model')}` does not exist.")
    state.chat_requests.append(messages)
    try:
        text = (state.chat_reply or default_reply)(messages)
    except Exception as e:  # the script's way to make the server fail this request
        raise HTTPError(500, f"{type(e).__name__}: {e}") from e
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    head = {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": state.model_name}
    return json_response(200, head | {"choices": [choice], "usage": {"completion_tokens": len(text.split())}})


def prompt_logprobs(state: FakeEngineState, prompt: list[int]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs of `prompt` under the fake model: each token's own log-prob and rank."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t in range(1, len(prompt)):
        lp_V = state.logprobs_V(prompt[:t])
        token = prompt[t]
        rank = int((lp_V > lp_V[token]).sum()) + 1
        out.append({str(token): {"logprob": float(lp_V[token]), "rank": rank, "decoded_token": ""}})
    return out
