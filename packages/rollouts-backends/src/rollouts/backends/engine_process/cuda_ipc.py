"""Weights by CUDA IPC handle, both sides of it: when the engine process runs on the trainer's GPU,
ProcessEngine.load_weights stages the weights in a bucket on that GPU (one device-to-device copy),
sends the bucket's IPC handle, and the engine process maps it and copies device to device into its
own model. No byte crosses the host.

Why a staging bucket rather than a handle to each of the trainer's storages: torch's
`_share_cuda_` wraps a storage in a reference-counted record that lives as long as the storage, so
sharing a model's parameters at every sync would pile up one record, one counter slot (in
/dev/shm) and one event per parameter per sync for the whole run. A bucket is freed after each
load: one handle, one counter, one event per bucket, and nothing left behind. The extra copy runs
at device bandwidth; the bucket bounds the extra memory (`EngineProcessOptions.ipc_bucket_bytes`).

Why the engine copies rather than aliases: the trainer changes its weights in place at its next
optimizer step; an engine sampling from that memory would serve a version it never loaded, half
updated while the step runs.

What crosses the pipe is JSON: the bucket's `IpcStorage` (rollouts.sync.ipc_handles: the handle
`_share_cuda_` gives, bytes as base64, its size, offset, reference counter and event) and per
tensor its name, dtype, shape and byte offset in the bucket. `IpcStorage.from_json` and `ipc_tensors` read it back, refusing
malformed data by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from rollouts.backends.engine_process.shared_weights import DTYPE_NAMES, DTYPES
from rollouts.sync.ipc_handles import IpcStorage, count_field, counts_field, object_fields

__all__ = [
    "TRANSPORTS",
    "IpcTensor",
    "buckets",
    "choose_transport",
    "ipc_tensors",
    "load_by_ipc",
    "mapped_views",
    "stage_bucket",
]

Transport = Literal["shared_memory", "cuda_ipc"]
TRANSPORTS = ("auto", "shared_memory", "cuda_ipc")
"""How `load_weights` moves tensors to the engine process: "auto" picks "cuda_ipc" when every tensor
is on the engine's own CUDA device, else "shared_memory" (a file in /dev/shm both map)."""
_ALIGN = 64  # each tensor of a bucket starts on 64 bytes: any dtype's view of its bytes is aligned


def choose_transport(requested: str, devices: Iterable[torch.device], engine_device: torch.device) -> Transport:
    """The transport for a load of tensors on `devices` into an engine on `engine_device`;
    ValueError for "cuda_ipc" asked of tensors that are not all on the engine's CUDA device."""
    if requested not in TRANSPORTS:
        raise ValueError(f"weights_transport must be one of {TRANSPORTS}, got {requested!r}")
    found = set(devices)
    colocated = engine_device.type == "cuda" and found == {engine_device}
    if requested == "cuda_ipc" and not colocated:
        raise ValueError(
            f"weights_transport='cuda_ipc' needs every tensor on the engine's device {engine_device}; "
            f"the weights are on {sorted(map(str, found))}"
        )
    if requested == "auto":
        return "cuda_ipc" if colocated else "shared_memory"
    return "cuda_ipc" if requested == "cuda_ipc" else "shared_memory"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class IpcTensor:
    """One tensor of a bucket: contiguous, at `offset_bytes` of the bucket."""

    name: str
    dtype: str
    """A name of shared_weights.DTYPES."""
    shape: tuple[int, ...]
    offset_bytes: int

    def num_bytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPES[self.dtype].itemsize

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset_bytes": self.offset_bytes}

    @classmethod
    def from_json(cls, data: Any, where: str) -> IpcTensor:
        fields = object_fields(data, where, {f.name for f in dataclasses.fields(cls)})
        name, dtype = fields["name"], fields["dtype"]
        if not isinstance(name, str):
            raise ValueError(f"{where}.name must be a string, got {name!r:.80}")
        if dtype not in DTYPES:
            raise ValueError(f"{where}.dtype must be one of {sorted(DTYPES)}, got {dtype!r:.80}")
        offset = count_field(fields, "offset_bytes", where)
        if offset % _ALIGN:
            raise ValueError(f"{where}.offset_bytes must be a multiple of {_ALIGN}, got {offset}")
        return cls(name=name, dtype=dtype, shape=counts_field(fields, "shape", where), offset_bytes=offset)


# ---------------------------------------------------------------- the trainer's side


def buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The names of `tensors` in order, grouped so that each group's bytes (aligned) stay within
    `bucket_bytes`; a tensor larger than that is a group of its own."""
    out: list[list[str]] = []
    used = bucket_bytes  # no open bucket yet
    for name, tensor in tensors.items():
        size = -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        if used + size > bucket_bytes or not out:
            out.append([])
            used = 0
        out[-1].append(name)
        used += size
    return out


def stage_bucket(tensors: Mapping[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[IpcTensor]]:
    """`tensors` copied (device to device) into one new flat byte buffer on `device`, and where each lies."""
    layout, offset = [], 0
    for name, tensor in tensors.items():
        offset = -(-offset // _ALIGN) * _ALIGN
        layout.append(
            IpcTensor(name=name, dtype=DTYPE_NAMES[tensor.dtype], shape=tuple(tensor.shape), offset_bytes=offset)
        )
        offset += tensor.numel() * tensor.element_size()
    flat = torch.empty(max(offset, 1), dtype=torch.uint8, device=device)  # a storage with no bytes has no handle
    for entry, tensor in zip(layout, tensors.values(), strict=True):
        target = flat[entry.offset_bytes : entry.offset_bytes + entry.num_bytes()]
        target.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
    return flat, layout


def load_by_ipc(
    tensors: Mapping[str, torch.Tensor],
    weight_version: int,
    device: torch.device,
    bucket_bytes: int,
    exchange: Callable[[dict[str, Any]], tuple[dict[str, Any], bytes]],
) -> dict[str, Any]:
    """Send `tensors` (on `device`) to the engine process by `exchange` (a request and its answer),
    one "load_cuda_ipc" request per staging bucket, each answered before its bucket is freed; the
    last answer, or the first refusal."""
    groups = buckets(tensors, bucket_bytes)
    torch.cuda.synchronize(device)  # the trainer's writes, on any stream, end before staging reads
    answer: dict[str, Any] = {}
    for i, names in enumerate(groups):
        flat, layout = stage_bucket({name: tensors[name] for name in names}, device)
        request = {
            "op": "load_cuda_ipc",
            "storage": IpcStorage.of(flat.untyped_storage()).to_json(),  # records the staging copies' event
            "tensors": [entry.to_json() for entry in layout],
            "weight_version": weight_version,
            "last": i == len(groups) - 1,
        }
        answer, _ = exchange(request)
        del flat  # the engine process has dropped its mapping: the bucket is freed here
        if not answer.get("ok"):
            break
    return answer


# ---------------------------------------------------------------- the engine process's side


def ipc_tensors(header: Mapping[str, Any], storage: IpcStorage) -> list[IpcTensor]:
    """The tensors of a bucket's header, each checked to lie inside the bucket."""
    tensors = header.get("tensors")
    if not isinstance(tensors, list):
        raise ValueError(f"a CUDA IPC load's 'tensors' must be a list, got {type(tensors).__name__}")
    out = [IpcTensor.from_json(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    for i, tensor in enumerate(out):
        end = tensor.offset_bytes + tensor.num_bytes()
        if end > storage.size_bytes:
            raise ValueError(
                f"tensors[{i}] ({tensor.name!r}) spans bytes {tensor.offset_bytes}..{end} "
                f"of a {storage.size_bytes}-byte bucket"
            )
    return out


def mapped_views(flat: torch.Tensor, tensors: list[IpcTensor]) -> dict[str, torch.Tensor]:
    """The bucket's tensors, as views of its mapped bytes `flat`."""
    return {
        t.name: flat[t.offset_bytes : t.offset_bytes + t.num_bytes()].view(DTYPES[t.dtype]).view(t.shape)
        for t in tensors
    }
