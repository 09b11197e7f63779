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

What crosses the pipe is JSON: the bucket's `IpcStorage` (the handle `_share_cuda_` gives, bytes
as base64, its size, offset, reference counter and event) and per tensor its name, dtype, shape
and byte offset in the bucket. `IpcStorage.from_json` and `ipc_tensors` read it back, refusing
malformed data by field.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from rollouts.backends.engine_process.shared_weights import DTYPE_NAMES, DTYPES

__all__ = [
    "TRANSPORTS",
    "IpcStorage",
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
class IpcStorage:
    """One CUDA storage of the trainer's process, as `UntypedStorage._share_cuda_` describes it."""

    device: int
    """CUDA device index the storage lives on."""
    handle: bytes
    """The IPC handle of the allocation (segment) holding the storage."""
    size_bytes: int
    offset_bytes: int
    """Where the storage starts in its allocation."""
    ref_counter_handle: bytes
    """Name of torch's shared reference counter, which keeps the memory alive while it is mapped."""
    ref_counter_offset: int
    event_handle: bytes
    """IPC handle of the event recorded on the trainer's stream when the storage was shared."""
    event_sync_required: bool

    @classmethod
    def of(cls, storage: torch.UntypedStorage) -> IpcStorage:
        """Share `storage` (a CUDA storage with data) by IPC; the caller keeps it alive until the
        other process has mapped, read and dropped it."""
        device, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()  # type: ignore[no-untyped-call]
        return cls(
            device=int(device),
            handle=bytes(handle),
            size_bytes=int(size),
            offset_bytes=int(offset),
            ref_counter_handle=bytes(counter),
            ref_counter_offset=int(counter_offset),
            event_handle=bytes(event),
            event_sync_required=bool(sync),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "handle": _b64(self.handle),
            "size_bytes": self.size_bytes,
            "offset_bytes": self.offset_bytes,
            "ref_counter_handle": _b64(self.ref_counter_handle),
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": _b64(self.event_handle),
            "event_sync_required": self.event_sync_required,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "storage") -> IpcStorage:
        """The storage `to_json` wrote; ValueError naming `where` and the field for anything else."""
        fields = _object(data, where, {f.name for f in dataclasses.fields(cls)})
        return cls(
            device=_count(fields, "device", where),
            handle=_bytes(fields, "handle", where),
            size_bytes=_count(fields, "size_bytes", where),
            offset_bytes=_count(fields, "offset_bytes", where),
            ref_counter_handle=_bytes(fields, "ref_counter_handle", where),
            ref_counter_offset=_count(fields, "ref_counter_offset", where),
            event_handle=_bytes(fields, "event_handle", where),
            event_sync_required=_flag(fields, "event_sync_required", where),
        )

    def mapped(self) -> torch.Tensor:
        """This process's view of the storage, as flat bytes on its device; streams here wait for the
        trainer's event before they read it. Drop it once read: the trainer's memory stays pinned
        while it lives."""
        storage = torch.UntypedStorage._new_shared_cuda(
            self.device,
            self.handle,
            self.size_bytes,
            self.offset_bytes,
            self.ref_counter_handle,
            self.ref_counter_offset,
            self.event_handle,
            self.event_sync_required,
        )
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{self.device}").set_(storage)


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
        fields = _object(data, where, {f.name for f in dataclasses.fields(cls)})
        name, dtype = fields["name"], fields["dtype"]
        if not isinstance(name, str):
            raise ValueError(f"{where}.name must be a string, got {name!r:.80}")
        if dtype not in DTYPES:
            raise ValueError(f"{where}.dtype must be one of {sorted(DTYPES)}, got {dtype!r:.80}")
        offset = _count(fields, "offset_bytes", where)
        if offset % _ALIGN:
            raise ValueError(f"{where}.offset_bytes must be a multiple of {_ALIGN}, got {offset}")
        return cls(name=name, dtype=dtype, shape=_counts(fields, "shape", where), offset_bytes=offset)


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


# ---------------------------------------------------------------- reading JSON fields


def _object(data: Any, where: str, names: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
    missing, unknown = sorted(names - data.keys()), sorted(data.keys() - names)
    if missing or unknown:
        raise ValueError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    return data


def _count(fields: Mapping[str, Any], key: str, where: str) -> int:
    value = fields[key]
    if type(value) is not int or value < 0:  # bool is an int subclass: refused too
        raise ValueError(f"{where}.{key} must be an integer >= 0, got {value!r:.80}")
    return value


def _counts(fields: Mapping[str, Any], key: str, where: str) -> tuple[int, ...]:
    value = fields[key]
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{where}.{key} must be a list of integers >= 0, got {value!r:.80}")
    return tuple(value)


def _flag(fields: Mapping[str, Any], key: str, where: str) -> bool:
    value = fields[key]
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key} must be true or false, got {value!r:.80}")
    return value


def _bytes(fields: Mapping[str, Any], key: str, where: str) -> bytes:
    value = fields[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a base64 string, got {value!r:.80}")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as e:
        raise ValueError(f"{where}.{key} is not base64 ({e})") from e


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
