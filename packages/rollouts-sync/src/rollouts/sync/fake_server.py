"""A fake engine server speaking vLLM's and SGLang's HTTP shapes, with faults a test can inject.

Runs in the caller's event loop, asyncio or trio (the minimal HTTP/1.1 of fake_http.py, on anyio),
so tests and benchmarks need no engine. The "model" is deterministic: next-token logits are a
pseudo-random function of (loaded weights, context), so a weight change changes the tokens and a
test can compute the expected greedy continuation with `FakeEngineState.greedy`.

Recorded shapes: vLLM 0.32 (entrypoints/openai/completion/protocol.py, rl/online/api_router.py,
serve/dev/{rpc,cache}/api_router.py) and SGLang (srt/entrypoints/http_server.py, io_struct.py).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import numpy as np
from anyio.abc import ByteStream, SocketAttribute

from rollouts.sync import fake_broadcast
from rollouts.sync.fake_chat import ChatReply, chat_completion, prompt_logprobs
from rollouts.sync.fake_http import Fault, HTTPError, json_response, pop_fault, read_request, send_response
from rollouts.sync.fake_rpc import collective_rpc, load_dir

_PAUSE_WAIT_S = 60.0  # a generate request waits at most this long for /resume


@dataclass(slots=True, kw_only=True)
class FakeEngineState:
    """Everything the fake server knows; tests read and change it between requests."""

    vocab_size: int = 32
    eos_token_id: int | None = None
    api_key: str | None = None
    """When set, requests without `Authorization: Bearer <api_key>` get 401."""
    reload_delay_s: float = 0.0
    """Seconds a weight reload takes (benchmarks use it as a stand-in for the real load)."""
    generate_delay_s: float = 0.0
    """Seconds each generate request stays in flight (a pause in mode "wait" drains it)."""
    abort_after_tokens: int | None = None  # cut /v1/completions choices there, finish_reason "abort"
    model_name: str = "fake-model"
    chat_reply: ChatReply | None = None
    """The reply to a /v1/chat/completions request's messages (None: `fake_chat.default_reply`)."""
    chat_requests: list[list[dict[str, Any]]] = field(default_factory=list)
    """The messages of every chat request, in arrival order."""
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    """The loaded weights, each in its own dtype (bfloat16 as its uint16 bit patterns)."""
    corrupt: str | None = None
    """Flip one bit of this tensor whenever it is received: the fault ROLLOUTS_SYNC_FAULT injects
    in a real engine (the fake's checksums then report it)."""
    staged_weights: dict[str, np.ndarray] = field(default_factory=dict)
    """Tensors of an update sent in chunks, waiting for its last chunk."""
    staged_ipc: dict[str, Any] | None = None
    """The IPC sync whose buckets are arriving: its token, plan, next bucket and tensors so far."""
    held: tuple[str, dict[str, np.ndarray]] | None = None
    """A held receive (hold=<token>): its token and tensors, loaded by rollouts_commit, dropped by rollouts_discard."""
    weight_version: str = "default"
    broadcast_group: Any = None
    """The weights-update process group the trainer made (SGLang's broadcast; see fake_broadcast)."""
    sessions: bool = False
    """Whether it has SGLang 0.5.23's weight-update sessions (and refuses a broadcast update outside one)."""
    in_session: bool = False
    paused: bool = False
    faults: list[Fault] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(method, request target) of every request, in arrival order."""
    auth_headers: list[str | None] = field(default_factory=list)
    num_cache_resets: int = 0
    num_in_flight: int = 0
    resumed: anyio.Event | None = None

    @property
    def weights_seed(self) -> int:
        """A checksum of the loaded weights (0 before any load)."""
        crc = 0
        for name in sorted(self.weights):
            crc = zlib.crc32(name.encode(), crc)
            crc = zlib.crc32(np.ascontiguousarray(self.weights[name]).tobytes(), crc)
        return crc

    def logprobs_V(self, context: list[int]) -> np.ndarray:
        """[V] next-token log-probs after `context` under the loaded weights."""
        rng = np.random.default_rng([self.weights_seed, len(context), context[-1] if context else 0])
        logits = rng.standard_normal(self.vocab_size) * 3.0
        out: np.ndarray = logits - (logits.max() + math.log(np.exp(logits - logits.max()).sum()))
        return out

    def score(self, ids: list[int]) -> float:
        """The fake reward model's score of a sequence (a pseudo-random function of it and the weights)."""
        return float(np.random.default_rng([self.weights_seed, len(ids), *ids[-4:]]).standard_normal())

    def greedy(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy response ids and their log-probs (the reference a test compares against)."""
        ids, lps, _ = self.sample(prompt, max_new_tokens=max_new_tokens, temperature=0.0, stop=set(), rng=None)
        return ids, lps

    def sample(
        self,
        prompt: list[int],
        *,
        max_new_tokens: int,
        temperature: float,
        stop: set[int],
        rng: np.random.Generator | None,
    ) -> tuple[list[int], list[float], str]:
        """(response ids, their log-probs, finish reason "stop" or "length"); `rng` only for temperature > 0."""
        context, ids, lps = list(prompt), [], []
        for _ in range(max_new_tokens):
            lp = self.logprobs_V(context)
            if temperature == 0.0 or rng is None:
                t = int(lp.argmax())
            else:
                p = np.exp(lp / temperature)
                t = int(rng.choice(self.vocab_size, p=p / p.sum()))
            ids.append(t)
            lps.append(float(lp[t]))
            context.append(t)
            if t in stop or t == self.eos_token_id:
                return ids, lps, "stop"
        return ids, lps, "length"

    def load_dir(self, path: str) -> None:
        """Load every *.safetensors file of checkpoint dir `path` (raises if there is none)."""
        self.weights = load_dir(self, path)


@dataclass(slots=True, kw_only=True)
class FakeEngineServer:
    """A running fake server: its URL, its state, and a way to take it down for good."""

    url: str
    state: FakeEngineState
    _scope: anyio.CancelScope

    def stop(self) -> None:
        """Close the listening socket: from now on connections are refused (an engine that never comes back)."""
        self._scope.cancel()


async def _wait_unpaused(state: FakeEngineState) -> None:
    with anyio.fail_after(_PAUSE_WAIT_S):
        while state.paused:
            assert state.resumed is not None
            await state.resumed.wait()


async def _generate_vllm(state: FakeEngineState, body: dict[str, Any]) -> tuple[int, bytes]:
    prompts = body.get("prompt")
    if not prompts or not isinstance(prompts[0], list):
        raise HTTPError(400, "prompt must be a list of token-id lists")
    if body.get("model") != state.model_name:
        raise HTTPError(404, f"The model `{body.get('model')}` does not exist.")
    n = int(body.get("n", 1))
    want_lp = body.get("logprobs") is not None
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    want_prompt_lp = body.get("prompt_logprobs") is not None
    rng = np.random.default_rng(body.get("seed"))
    choices: list[dict[str, Any]] = []
    for prompt in prompts:
        for _ in range(n):
            ids, lps, finish = state.sample(
                prompt,
                max_new_tokens=int(body.get("max_tokens", 16)),
                temperature=float(body.get("temperature", 1.0)),
                stop=set(body.get("stop_token_ids") or []),
                rng=rng,
            )
            if (cut := state.abort_after_tokens) is not None and len(ids) > cut:
                ids, lps, finish = ids[:cut], lps[:cut], "abort"
            logprobs = None
            if want_lp:
                tokens = [f"token_id:{t}" if as_ids else "" for t in ids]  # vLLM sends "" for byte tokens
                logprobs = {
                    "text_offset": list(range(len(ids))),
                    "token_logprobs": lps,
                    "tokens": tokens,
                    "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps, strict=True)],
                }
            choices.append(
                {
                    "index": len(choices),
                    "text": "",
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": ids[-1] if finish == "stop" else None,
                    "token_ids": ids if body.get("return_token_ids") else None,
                    "prompt_logprobs": prompt_logprobs(state, prompt) if want_prompt_lp else None,
                    "prompt_token_ids": None,
                }
            )
    usage = {
        "prompt_tokens": sum(len(p) for p in prompts) * n,
        "completion_tokens": sum(len(c["logprobs"]["tokens"]) if c["logprobs"] else 0 for c in choices),
    }
    head = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": state.model_name}
    return json_response(200, head | {"choices": choices, "usage": usage})


async def _generate_sglang(state: FakeEngineState, body: dict[str, Any]) -> tuple[int, bytes]:
    inputs = body.get("input_ids")
    if not inputs:
        raise HTTPError(400, "input_ids is required")
    batched = isinstance(inputs[0], list)
    inputs = inputs if batched else [inputs]
    params = body.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(inputs)
    if len(params) != len(inputs):
        raise HTTPError(400, f"sampling_params has {len(params)} entries for {len(inputs)} inputs")
    unseeded = np.random.default_rng()
    outs = []
    for prompt, sp in zip(inputs, params, strict=True):
        # Like SGLang's seeded sampler: a row's seed alone decides its tokens (equal seeds, equal rows).
        seed = sp.get("sampling_seed")
        rng = unseeded if seed is None else np.random.default_rng(seed)
        ids, lps, finish = state.sample(
            prompt,
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            temperature=float(sp.get("temperature", 1.0)),
            stop=set(sp.get("stop_token_ids") or []),
            rng=rng,
        )
        finish_reason = (
            {"type": "length", "length": len(ids)} if finish == "length" else {"type": "stop", "matched": ids[-1]}
        )
        meta: dict[str, Any] = {
            "id": "fake",
            "finish_reason": finish_reason,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": state.weight_version,
        }
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        outs.append({"text": "", "output_ids": ids, "meta_info": meta})
    return json_response(200, outs if batched else outs[0])


async def _dispatch(state: FakeEngineState, method: str, target: str, body: bytes) -> tuple[int, bytes]:
    path = urlsplit(target).path
    query = parse_qs(urlsplit(target).query)
    data = json.loads(body) if body else {}
    route = (method, path)
    if route in (("GET", "/health"), ("GET", "/health_generate")):
        return 200, b""
    if route == ("GET", "/v1/models"):
        return json_response(200, {"object": "list", "data": [{"id": state.model_name, "object": "model"}]})
    if route == ("POST", "/classify"):  # a one-label reward model: a score per sequence of token ids
        inputs = data.get("input")
        if not isinstance(inputs, list) or not all(isinstance(ids, list) and ids for ids in inputs):
            raise HTTPError(400, "input must be a list of non-empty token id lists")
        rows = [
            {"index": i, "label": None, "probs": [state.score(ids)], "num_classes": 1} for i, ids in enumerate(inputs)
        ]
        return json_response(200, {"object": "list", "model": state.model_name, "data": rows})
    if route == ("POST", "/v1/chat/completions"):
        return chat_completion(state, data)
    if route in (("POST", "/v1/completions"), ("POST", "/generate")):
        await _wait_unpaused(state)
        state.num_in_flight += 1
        try:
            await anyio.sleep(state.generate_delay_s)
            return await (_generate_vllm if path == "/v1/completions" else _generate_sglang)(state, data)
        finally:
            state.num_in_flight -= 1
    if route in (("POST", "/pause"), ("POST", "/pause_generation")):
        mode = query.get("mode", ["abort"])[0] if path == "/pause" else data.get("mode")  # SGLang: a JSON body
        if mode not in (("abort", "wait", "keep") if path == "/pause" else ("abort", "retract", "in_place")):
            raise HTTPError(
                400, f"mode: Input should be one of vLLM's or SGLang's pause modes (a body field for SGLang): {mode!r}"
            )
        state.paused = True
        state.resumed = anyio.Event()
        with anyio.fail_after(_PAUSE_WAIT_S):
            while state.num_in_flight > 0:
                await anyio.sleep(0.01)
        if path == "/pause":
            return json_response(200, {"status": "paused"})
        return json_response(200, {"message": "Generation paused successfully.", "status": "ok"})
    if route in (("POST", "/resume"), ("POST", "/continue_generation")):
        state.paused = False
        if state.resumed is not None:
            state.resumed.set()
        if path == "/resume":
            return json_response(200, {"status": "resumed"})
        return json_response(200, {"message": "Generation continued successfully.", "status": "ok"})
    if route == ("GET", "/is_paused"):
        return json_response(200, {"is_paused": state.paused})
    if route in fake_broadcast.ROUTES:
        return await fake_broadcast.dispatch(state, path, data)
    if route == ("POST", "/collective_rpc"):
        return await collective_rpc(state, data)
    if route in (("POST", "/reset_prefix_cache"), ("POST", "/flush_cache"), ("GET", "/flush_cache")):
        state.num_cache_resets += 1
        if path == "/reset_prefix_cache":
            return json_response(200, {"success": True})
        return 200, b"Cache flushed.\n"
    if route == ("POST", "/update_weight_version"):
        if "new_version" not in data:
            raise HTTPError(400, "new_version: Field required")
        state.weight_version = str(data["new_version"])
        return json_response(200, {"success": True, "new_version": state.weight_version})
    if route in (("GET", "/weight_info"), ("GET", "/get_weight_version"), ("GET", "/model_info")):
        return json_response(200, {"weight_version": state.weight_version})
    if route == ("POST", "/update_weights_from_disk"):
        await anyio.sleep(state.reload_delay_s)
        try:
            state.load_dir(data["model_path"])
        except (OSError, KeyError) as exc:
            return json_response(
                400, {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
            )
        message = "Succeeded to update model weights."
        if data.get("weight_version") is not None:
            state.weight_version = str(data["weight_version"])
            message += f" Weight version updated to {data['weight_version']}."
        return json_response(200, {"success": True, "message": message, "num_paused_requests": 0})
    raise HTTPError(404, f"Not Found: {method} {path}")


async def _handle(state: FakeEngineState, stream: ByteStream) -> None:
    try:
        request = await read_request(stream)
        if request is None:
            return
        method, target, headers, body = request
        state.calls.append((method, target))
        state.auth_headers.append(headers.get("authorization"))
        fault = pop_fault(state.faults, urlsplit(target).path)
        if fault is not None and fault.kind == "drop":
            return
        if fault is not None and fault.kind == "delay":
            await anyio.sleep(fault.delay_s)
        if fault is not None and fault.kind == "status":
            status, payload = json_response(fault.status, {"error": fault.text})
        elif state.api_key is not None and headers.get("authorization") != f"Bearer {state.api_key}":
            status, payload = json_response(401, {"error": "Unauthorized"})
        else:
            try:
                status, payload = await _dispatch(state, method, target, body)
            except HTTPError as exc:
                status, payload = json_response(exc.status, {"error": exc.text})
        await send_response(stream, status, payload)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


@asynccontextmanager
async def serve_fake_engine(
    state: FakeEngineState | None = None, *, host: str = "127.0.0.1"
) -> AsyncIterator[FakeEngineServer]:
    """Run a fake engine on a free loopback port for the body of the `async with`."""
    state = state if state is not None else FakeEngineState()
    async with anyio.create_task_group() as tg:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=0)
        port = listener.extra(SocketAttribute.local_port)
        scope = anyio.CancelScope()

        async def serve() -> None:
            with scope:
                async with listener:
                    await listener.serve(partial(_handle, state))

        tg.start_soon(serve)
        try:
            yield FakeEngineServer(url=f"http://{host}:{port}", state=state, _scope=scope)
        finally:
            tg.cancel_scope.cancel()
