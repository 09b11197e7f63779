"""The fake engine's /collective_rpc: the worker extension's weight loads and fingerprints, done on
the fake's numpy weights the way rollouts.sync.worker_extension does them in vLLM's workers (held
loads too: hold=<token> keeps a receive unloaded for rollouts_commit or rollouts_discard).

Weights arrive as safetensors bytes in their own dtype and are kept as numpy arrays (16-bit floats
numpy lacks, e.g. bfloat16, as their uint16 bit patterns: the fake's "model" only hashes bytes).
"""

from __future__ import annotations

import base64
import json
import math
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import numpy as np

from rollouts.sync.fake_http import HTTPError, json_response
from rollouts.sync.fingerprint import fingerprint
from rollouts.sync.raw import DTYPE_BYTES, TORCH_NAMES, RawTensor, decode_safetensors, read_safetensors_dir

if TYPE_CHECKING:
    from rollouts.sync.fake_server import FakeEngineState


def arrays(tensors: dict[str, RawTensor], *, corrupt: str | None) -> dict[str, np.ndarray]:
    """`tensors` as numpy arrays of their own (copies), with one bit of `corrupt` flipped: what
    ROLLOUTS_SYNC_FAULT injects in a real engine."""
    out = {name: np.array(tensor.view()) for name, tensor in tensors.items()}
    if corrupt in out and out[corrupt].size:
        out[corrupt].reshape(-1).view(np.uint8)[0] ^= 1
    return out


def load_dir(state: FakeEngineState, path: str) -> dict[str, np.ndarray]:
    """Every *.safetensors file of checkpoint dir `path`, read (raises if there is none)."""
    try:
        return arrays(read_safetensors_dir(path), corrupt=state.corrupt)
    except ValueError as exc:
        raise FileNotFoundError(str(exc)) from exc


def load(state: FakeEngineState, incoming: dict[str, np.ndarray], kwargs: dict[str, Any]) -> None:
    """`incoming` into the weights, or held for rollouts_commit with kwargs hold=<token>."""
    hold = str(kwargs.get("hold", "0"))
    state.held = None if hold == "0" else (hold, incoming)
    if state.held is None:
        state.weights = {**state.weights, **incoming}


async def fetch(kwargs: dict[str, Any]) -> bytes:
    """The bytes at kwargs["url"], checked to be kwargs["num_bytes"] long (a 500 naming what went wrong)."""
    timeout_s = float(kwargs["timeout_s"])
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            response = await client.get(kwargs["url"])
    except httpx.HTTPError as exc:
        raise HTTPError(500, f"fetching weights failed: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200 or len(response.content) != int(kwargs["num_bytes"]):
        raise HTTPError(500, f"fetching weights: {response.status_code} with {len(response.content)} bytes")
    return response.content


def receive_ipc(state: FakeEngineState, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One bucket of an IPC sync (rollouts.sync.ipc), read from its shared-memory file; the last one
    loads them all (all or nothing), as rollouts.sync.worker_ipc does."""
    k, token = int(kwargs["index"]), kwargs["token"]
    if k == 0:
        state.held = None
        state.staged_ipc = {"token": token, "plan": json.loads(kwargs["plan_json"]), "next": 0, "tensors": {}}
    staged = state.staged_ipc
    if staged is None or staged["token"] != token or staged["next"] != k:
        raise ValueError(f"bucket {k} of sync {token} arrived out of turn")
    shm = json.loads(kwargs["handle_json"])["shm"]
    bucket = staged["plan"]["buckets"][k]
    data = np.fromfile(shm["path"], dtype=np.uint8, count=int(bucket["nbytes"]))  # the file may be larger
    for name, dtype, shape, offset in bucket["tensors"]:
        kind = TORCH_NAMES[f"torch.{dtype}"]
        size = math.prod(shape) * DTYPE_BYTES[kind]
        staged["tensors"][name] = RawTensor(dtype=kind, shape=tuple(shape), data=data[offset : offset + size])
    staged["next"] += 1
    if staged["next"] < len(staged["plan"]["buckets"]):
        return {"bucket": k}
    state.staged_ipc = None
    incoming = arrays(staged["tensors"], corrupt=state.corrupt)
    unknown = sorted(set(incoming) - set(state.weights)) if state.weights else []
    if unknown:
        raise ValueError(f"tensors not in the model's checkpoint: {unknown}")
    load(state, incoming, kwargs)
    return {"num_tensors": len(incoming), "checksums": fingerprint(incoming)}


async def collective_rpc(state: FakeEngineState, body: dict[str, Any]) -> tuple[int, bytes]:
    method, kwargs = body.get("method"), body.get("kwargs") or {}
    if method is None:
        raise HTTPError(400, "Missing 'method' in request body")
    if method == "reload_weights":
        await anyio.sleep(state.reload_delay_s)
        try:
            state.weights = load_dir(state, kwargs["weights_path"])
        except (OSError, KeyError) as exc:
            raise HTTPError(500, f"reload_weights failed: {type(exc).__name__}: {exc}") from exc
        return 200, b""  # vLLM answers an empty 200 when every worker returned None
    if method == "rollouts_load_weights":
        await anyio.sleep(state.reload_delay_s)
        # Staged like the worker extension: the first chunk clears, the last applies, an error drops all.
        if kwargs.get("first", "1") == "1":
            state.staged_weights, state.held = {}, None
        incoming = arrays(decode_safetensors(base64.b64decode(kwargs["data_b64"])), corrupt=state.corrupt)
        unknown = sorted(set(incoming) - set(state.weights)) if state.weights else []
        if unknown:
            state.staged_weights = {}
            raise HTTPError(500, f"tensors not in the model's checkpoint: {unknown}")
        state.staged_weights.update(incoming)
        applied = kwargs.get("apply") == "1"
        if applied:
            load(state, state.staged_weights, kwargs)
            state.staged_weights = {}
        result = {"num_tensors": len(incoming), "applied": applied, "checksums": fingerprint(incoming)}
        return json_response(200, {"results": [result]})
    if method == "rollouts_fetch_weights":  # raw safetensors bytes GET from the trainer's one-off URL
        await anyio.sleep(state.reload_delay_s)
        state.held = None  # a receive drops what the one before it held, as the worker does
        incoming = arrays(decode_safetensors(await fetch(kwargs)), corrupt=state.corrupt)
        unknown = sorted(set(incoming) - set(state.weights)) if state.weights else []
        if unknown:
            raise HTTPError(500, f"tensors not in the model's checkpoint: {unknown}")
        load(state, incoming, kwargs)
        return json_response(200, {"results": [{"num_tensors": len(incoming), "checksums": fingerprint(incoming)}]})
    if method == "rollouts_load_dir":  # a disk reload answering the checksums of what it read
        await anyio.sleep(state.reload_delay_s)
        state.held = None
        try:
            incoming = load_dir(state, kwargs["weights_path"])
        except (OSError, KeyError) as exc:
            raise HTTPError(500, f"rollouts_load_dir failed: {type(exc).__name__}: {exc}") from exc
        load(state, incoming, kwargs)
        return json_response(200, {"results": [{"checksums": fingerprint(incoming)}]})
    if method == "rollouts_receive_ipc":  # a bucket in a /dev/shm file (the fake runs on the CPU)
        await anyio.sleep(state.reload_delay_s)
        try:
            return json_response(200, {"results": [receive_ipc(state, kwargs)]})
        except (OSError, KeyError, ValueError) as exc:
            state.staged_ipc = None
            raise HTTPError(500, f"rollouts_receive_ipc failed: {type(exc).__name__}: {exc}") from exc
    if method in ("rollouts_commit", "rollouts_discard"):
        held = state.held if state.held is not None and state.held[0] == kwargs.get("token") else None
        if held is None and method == "rollouts_commit":
            raise HTTPError(500, f"RuntimeError: commit of receive {kwargs.get('token')!r}: it is not held")
        state.held = None if held is not None else state.held
        if held is not None and method == "rollouts_commit":
            state.weights = {**state.weights, **held[1]}
        return json_response(200, {"results": [{"num_tensors": 0 if held is None else len(held[1])}]})
    if method == "rollouts_fingerprint":  # the checksums of what the last disk reload loaded
        return json_response(200, {"results": [{"checksums": fingerprint(state.weights)}]})
    raise HTTPError(500, f"AttributeError: worker has no method {method!r}")
