"""The weight-update requests of vLLM's worker extension: tensors in their own dtype as base64
safetensors in /collective_rpc bodies, and the checksums the workers answer with.

vLLM's /collective_rpc takes JSON whose arguments are strings, so the safetensors bytes travel
base64-encoded: the bodies are a third larger than the tensors.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollouts.sync._http import EngineError
from rollouts.sync.raw import RawTensor, as_raw, encode_safetensors


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorUpload:
    """What one `update_weights_from_tensors` moved."""

    num_tensors: int
    tensor_bytes: int
    """The tensors' own bytes, in their own dtype (a bf16 weight: 2 bytes per element)."""
    body_bytes: int
    """The request bodies' bytes: vLLM's /collective_rpc takes JSON with string arguments only, so
    the safetensors bytes travel base64-encoded, a third more than `tensor_bytes`, plus the headers."""
    num_requests: int


def upload_of(raw: Mapping[str, RawTensor], rpcs: list[dict[str, Any]]) -> TensorUpload:
    """What sending `raw` as `rpcs` (from `tensor_rpc_bodies`) moves."""
    return TensorUpload(
        num_tensors=len(raw),
        tensor_bytes=sum(t.nbytes for t in raw.values()),
        body_bytes=sum(body_bytes(rpc) for rpc in rpcs),
        num_requests=len(rpcs),
    )


def body_bytes(rpc: Mapping[str, Any]) -> int:
    """Bytes of `rpc` as compact JSON, counted without encoding the payload again (base64 needs no escapes)."""
    kwargs = rpc["kwargs"]
    rest = {**rpc, "kwargs": {**kwargs, "data_b64": ""}}
    return len(json.dumps(rest, separators=(",", ":"))) + len(kwargs["data_b64"])


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
