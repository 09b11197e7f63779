"""The weight-update requests of vLLM's worker extension, and the checksums the workers answer with.

Two wires: "fetch" (one request carrying a URL: the workers GET the raw safetensors bytes from a
one-off endpoint the trainer serves, rollouts.sync.raw_server) and "inline" (the safetensors bytes
in the request bodies: vLLM's /collective_rpc takes JSON whose arguments are strings, so they travel
base64-encoded, a third larger than the tensors).
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import anyio

from rollouts.sync._http import EngineError
from rollouts.sync.raw import RawTensor, as_raw, encode_safetensors

WORKER_EXTENSION_CLS = "rollouts.sync.worker_extension.SafetensorsWeightLoader"
"""Pass to vLLM as --worker-extension-cls so update_weights_from_tensors works without a shared disk."""
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024  # one inline /collective_rpc body stays well below HTTP server limits


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorUpload:
    """What one `update_weights_from_tensors` moved."""

    num_tensors: int
    tensor_bytes: int
    """The tensors' own bytes, in their own dtype (a bf16 weight: 2 bytes per element)."""
    body_bytes: int
    """The request bodies' bytes: inline, the safetensors bytes base64-encoded (a third more than
    `tensor_bytes`) in JSON; fetched, only the URL and sizes."""
    num_requests: int
    fetched_bytes: int = 0
    """Bytes the server's workers fetched from this process (fetch wire): each worker gets the
    safetensors payload, `tensor_bytes` plus its header, once."""
    shared_bytes: int = 0
    """Bytes of the buckets shared with the server's workers by IPC (ipc wire: no tensor byte in a
    body or on a socket; each worker copies the buckets out of this process's memory)."""

    @property
    def wire_bytes(self) -> int:
        """Every byte the sync moved to the server: request bodies and fetched payloads."""
        return self.body_bytes + self.fetched_bytes


def upload_of(raw: Mapping[str, RawTensor], rpcs: list[dict[str, Any]], *, fetched_bytes: int = 0) -> TensorUpload:
    """What sending `raw` as `rpcs` (from `tensor_rpc_bodies`, or one `fetch_rpc_body`) moves."""
    return TensorUpload(
        num_tensors=len(raw),
        tensor_bytes=sum(t.nbytes for t in raw.values()),
        body_bytes=sum(body_bytes(rpc) for rpc in rpcs),
        num_requests=len(rpcs),
        fetched_bytes=fetched_bytes,
    )


def body_bytes(rpc: Mapping[str, Any]) -> int:
    """Bytes of `rpc` as compact JSON, counted without encoding the payload again (base64 needs no escapes)."""
    kwargs = rpc["kwargs"]
    payload = kwargs.get("data_b64", "")
    rest = {**rpc, "kwargs": {**kwargs, "data_b64": ""}} if payload else rpc
    return len(json.dumps(rest, separators=(",", ":"))) + len(payload)


def fetch_rpc_body(url: str, num_bytes: int, *, timeout_s: float, checksums: bool = True) -> dict[str, Any]:
    """The /collective_rpc body that has each worker GET `num_bytes` of safetensors from `url` (within
    `timeout_s`) and load them, answering their checksums unless `checksums` is False."""
    kwargs = {"url": url, "num_bytes": str(num_bytes), "timeout_s": str(timeout_s)}
    if not checksums:  # named only when off: a worker extension from before it takes the call as it was
        kwargs["checksums"] = "0"
    return {"method": "rollouts_fetch_weights", "kwargs": kwargs}


def held_rpc_body(method: str, token: str) -> dict[str, Any]:
    """The /collective_rpc body of a held sync's "rollouts_commit" or "rollouts_discard" (the
    worker extension's HeldLoads), naming the sync by its `token`."""
    return {"method": method, "kwargs": {"token": token}}


def merge_checksums(reported: list[dict[str, int]], data: Mapping[str, Any]) -> list[dict[str, int]]:
    """Each worker's checksums so far, with those of one /collective_rpc answer (one result per worker)."""
    results = [r for r in data.get("results") or [] if isinstance(r, dict) and "checksums" in r]
    merged = [dict(r) for r in reported] + [{} for _ in range(len(results) - len(reported))]
    for worker, result in zip(merged, results, strict=False):
        worker.update({str(k): int(v) for k, v in result["checksums"].items()})
    return merged


def raw_tensors(tensors: Mapping[str, Any]) -> dict[str, RawTensor]:
    """`tensors` (numpy arrays, torch tensors of any dtype, RawTensors) as RawTensors in their own dtype."""
    if not isinstance(tensors, Mapping) or not tensors:
        raise ValueError("tensors must be a non-empty mapping of name -> numpy array, torch tensor or RawTensor")
    return {name: as_raw(value, name=f"tensors[{name!r}]") for name, value in tensors.items()}


def tensor_rpc_bodies(tensors: Mapping[str, Any], *, chunk_bytes: int) -> list[dict[str, Any]]:
    """/collective_rpc bodies carrying `tensors` (see `raw_tensors`) as base64 safetensors in their own
    dtype, at most ~chunk_bytes of tensor bytes each.

    All but the last body only stage their tensors; the last one applies everything staged.
    """
    raw = raw_tensors(tensors)
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    chunks: list[dict[str, RawTensor]] = [{}]
    size = 0
    for name, tensor in raw.items():
        if chunks[-1] and size + tensor.nbytes > chunk_bytes:
            chunks.append({})
            size = 0
        chunks[-1][name] = tensor
        size += tensor.nbytes
    bodies = []
    for i, chunk in enumerate(chunks):
        payload = base64.b64encode(encode_safetensors(chunk)).decode("ascii")
        apply = "1" if i == len(chunks) - 1 else "0"
        first = "1" if i == 0 else "0"
        bodies.append(
            {"method": "rollouts_load_weights", "kwargs": {"data_b64": payload, "apply": apply, "first": first}}
        )
    return bodies


def raise_on_rpc_error(data: Mapping[str, Any], *, engine: str, url: str) -> None:
    """Raise EngineError for the first worker whose /collective_rpc result is an error."""
    for result in data.get("results") or []:
        if isinstance(result, dict) and result.get("error"):
            raise EngineError(
                f"{engine}: collective_rpc failed: {result['error']}",
                engine=engine,
                url=url,
                status=200,
                text=str(result["error"]),
            )


def with_extension_hint(e: EngineError, method: str) -> EngineError:
    """`e`, saying how to start the server, when the worker lacks the extension's `method` (vLLM:
    "Method ... is not implemented"), or has one from another version (an unexpected keyword)."""
    text = str(e)
    missing = method in text and any(m in text for m in ("is not implemented", "has no method", "has no attribute"))
    if not method.startswith("rollouts_") or not (missing or "unexpected keyword argument" in text):
        return e
    return EngineError(
        f"{e} (the worker has no {method} as this client calls it: start the server with "
        f"--worker-extension-cls {WORKER_EXTENSION_CLS} of this rollouts-sync version, as `rollouts engine "
        "vllm` does; or pass attest=False / set engine.attest = "
        "false for a disk sync without it)",
        engine=e.engine,
        url=e.url,
        status=e.status,
        text=e.text,
    )


class Background:
    """`fn(arg)` computed in a thread of its own from construction on (the sender's checksums, while
    the engine loads); `await result()` waits for its value or raises its error."""

    def __init__(self, fn: Callable[[Any], dict[str, int]], arg: Any) -> None:
        self._future: Future[dict[str, int]] = Future()
        threading.Thread(target=self._run, args=(fn, arg), name="rollouts-checksums", daemon=True).start()

    def _run(self, fn: Callable[[Any], dict[str, int]], arg: Any) -> None:
        try:
            self._future.set_result(fn(arg))
        except BaseException as e:  # noqa: BLE001 - handed to whoever awaits the result
            self._future.set_exception(e)

    async def result(self) -> dict[str, int]:
        # a cancelled wait (a deadline) returns at once: the thread, a daemon, ends on its own
        return await anyio.to_thread.run_sync(self._future.result, abandon_on_cancel=True)
