"""The receiving end of a sync in vLLM's worker, host memory and the fetch wire (standard library
and torch only): the buffer a sync lands in, kept from one sync to the next (`ReceiveBuffer`); the
raw safetensors fetch (`fetch_bytes`, `tensors_of_safetensors`) and its checksums taken as the bytes
arrive (`ChecksumsOnArrival`); where an NCCL sync's buckets wait for the load (`stage_on_host`); the
checkpoint files the worker reads and writes, and its host cache of the weights it serves; an
attested sync's held load (`HeldLoads`).

Fresh memory for each sync would be faulted in page by page every time (about 0.45 s per GB on a
CPU here: more than the loopback transfer itself); the buffer kept instead stays mapped between syncs
(the same peak as a sync that allocates).

rollouts.sync.worker_extension uses it; a server started by rollouts.sync.launch gets a copy beside
the extension, as rollouts_worker_receive.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from safetensors.torch import load_file

try:
    from rollouts.sync.fingerprint_torch import fingerprint_torch, flip_bit_torch, sync_fault_target
except ModuleNotFoundError:  # in a server started by rollouts.sync.launch: the copy beside this one
    from rollouts_fingerprint_torch import fingerprint_torch, flip_bit_torch, sync_fault_target  # type: ignore[no-redef,import-not-found]

__all__ = [
    "DEVICE_HEADROOM_BYTES",
    "ChecksumsOnArrival",
    "HeldLoads",
    "TORCH_DTYPE_NAMES",
    "ReceiveBuffer",
    "fetch_bytes",
    "files_signature",
    "keep_in_cache",
    "keep_newest",
    "read_dir",
    "stage_on_host",
    "tensors_of_safetensors",
    "write_whole",
]

TORCH_DTYPE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}
"""torch's name of each safetensors dtype."""


DEVICE_HEADROOM_BYTES = 1 << 30
"""GPU memory a broadcast held on the device leaves free beyond its buckets (vLLM's reload
materializes a layer at a time)."""


def stage_on_host(device: Any, stage: str, num_bytes: int) -> bool:
    """Whether a broadcast of `num_bytes` into GPU `device` is held on the host until the load (each
    bucket copied out as it arrives: one bucket's room on the GPU) rather than on the GPU: `stage`
    "host", "device", or "auto" (the host unless the GPU has room for every bucket plus
    DEVICE_HEADROOM_BYTES, free or held free by torch's allocator). A gloo group's buckets are on
    the host already: False."""
    if stage not in ("auto", "device", "host"):
        raise ValueError(f"stage must be 'auto', 'device' or 'host', got {stage!r}")
    if device.type == "cpu" or stage == "device":
        return False
    if stage == "host":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    held_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return bool(num_bytes + DEVICE_HEADROOM_BYTES > free + held_free)


class ReceiveBuffer:
    """Host memory kept from one sync to the next: `take(sizes)` gives a uint8 view per size (each at a
    64-byte-aligned offset of one buffer, grown when a sync needs more), so a receive writes pages
    already mapped instead of faulting in fresh ones. The views of one `take` are valid until the next."""

    ALIGN = 64

    def __init__(self) -> None:
        self._buffer: Any = None

    def take(self, sizes: list[int]) -> list[Any]:
        offsets, total = [], 0
        for size in sizes:
            if size < 0:
                raise ValueError(f"a receive buffer's size must be >= 0, got {size}")
            offsets.append(total)
            total += -(-size // self.ALIGN) * self.ALIGN
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = None  # the old one goes before the new one is mapped: one buffer at a time
            self._buffer = torch.empty(total, dtype=torch.uint8)
        return [self._buffer[start : start + size] for start, size in zip(offsets, sizes, strict=True)]


def fetch_bytes(
    url: str, num_bytes: int, timeout_s: float, *, into: Any = None, on_progress: Callable[[int], None] | None = None
) -> Any:
    """The `num_bytes` bytes GET `url` answers, read into one uint8 tensor (`into`, a contiguous uint8
    CPU tensor of `num_bytes`, when given; else a new one), all within `timeout_s`. `on_progress` is
    called with the count of bytes in the buffer after each read."""
    if into is not None and (into.dtype != torch.uint8 or into.numel() != num_bytes or not into.is_contiguous()):
        raise ValueError(
            f"into must be a contiguous uint8 tensor of {num_bytes} bytes, got {into.dtype} of {into.numel()}"
        )
    parts = urllib.parse.urlsplit(url)
    where = f"{parts.hostname}:{parts.port}"  # the path holds the token: never in a message
    deadline = time.monotonic() + timeout_s
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path)
        sock = conn.sock  # the response keeps reading it after the connection hands it over (Connection: close)
        response = conn.getresponse()
        length = response.getheader("Content-Length")
        if response.status != 200 or length != str(num_bytes):
            raise RuntimeError(
                f"fetching weights from {where}: answered {response.status} with Content-Length {length}, "
                f"expected 200 with {num_bytes}"
            )
        buffer = torch.empty(num_bytes, dtype=torch.uint8) if into is None else into
        view = buffer.numpy().data
        received = 0
        while received < num_bytes:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"fetching weights from {where}: {received} of {num_bytes} bytes in {timeout_s} s")
            # one read of the socket at a time, each bounded by the time left: a read filling the whole
            # buffer would wait for all of it, and a trickle of bytes would hold it past the deadline
            sock.settimeout(left_s)
            try:
                got = response.fp.readinto1(view[received:])
            except TimeoutError as e:
                raise TimeoutError(
                    f"fetching weights from {where}: {received} of {num_bytes} bytes in {timeout_s} s"
                ) from e
            if not got:
                raise RuntimeError(f"fetching weights from {where}: closed after {received} of {num_bytes} bytes")
            received += got
            if on_progress is not None:
                on_progress(received)
        return buffer
    finally:
        conn.close()


class ChecksumsOnArrival:
    """The checksums of a safetensors payload's tensors, each computed in a thread of `pool` as soon as
    its bytes are in `buffer` (give it to fetch_bytes as `on_progress`), so they overlap the rest of
    the fetch. The fault ROLLOUTS_SYNC_FAULT asks for is injected into its tensor before its sum."""

    def __init__(self, buffer: Any, pool: ThreadPoolExecutor) -> None:
        self._buffer = buffer
        self._pool = pool
        self._fault = sync_fault_target()
        self._spans: list[tuple[int, str, int]] | None = None  # (end, name, start) in the buffer, by end
        self._pending: list[tuple[str, Any]] = []

    def __call__(self, received: int) -> None:
        if self._spans is None:
            if received < 8:
                return
            head = int.from_bytes(self._buffer[:8].numpy().tobytes(), "little")
            if received < 8 + head:
                return
            header = json.loads(self._buffer[8 : 8 + head].numpy().tobytes())
            spans = [
                (8 + head + int(entry["data_offsets"][1]), name, 8 + head + int(entry["data_offsets"][0]))
                for name, entry in header.items()
                if name != "__metadata__"
            ]
            self._spans = sorted(spans, reverse=True)  # the next to arrive last: popped first
        while self._spans and self._spans[-1][0] <= received:
            end, name, start = self._spans.pop()
            data = self._buffer[start:end]
            if name == self._fault:
                flip_bit_torch(data)
            self._pending.append((name, self._pool.submit(fingerprint_torch, {name: data})))

    def result(self) -> dict[str, int]:
        """Every tensor's checksum (call once the whole payload arrived)."""
        if self._spans:
            raise RuntimeError(f"{len(self._spans)} tensors of the payload never arrived")
        return {name: done.result()[name] for name, done in self._pending}


def tensors_of_safetensors(buffer: Any) -> dict[str, Any]:
    """The tensors of a safetensors payload in uint8 tensor `buffer`, as views of it (a copy only for
    a tensor whose offset its dtype cannot view at)."""
    head = int.from_bytes(buffer[:8].numpy().tobytes(), "little")
    if buffer.numel() < 8 or head > buffer.numel() - 8:
        raise ValueError(f"a safetensors payload of {buffer.numel()} bytes names a header of {head}")
    header = json.loads(buffer[8 : 8 + head].numpy().tobytes())
    body = buffer[8 + head :]
    if not isinstance(header, dict):
        raise ValueError(f"a safetensors header must be a JSON object, got {type(header).__name__}")
    out = {}
    end_before = 0
    entries = [(name, entry) for name, entry in header.items() if name != "__metadata__"]
    for name, entry in sorted(entries, key=lambda item: _data_start(item[1])):
        start, end, shape, kind = _checked_entry(name, entry)
        if start < end_before or end > body.numel():
            raise ValueError(
                f"safetensors tensor {name!r}: bytes [{start}, {end}) overlap the tensor before it (which ends at "
                f"{end_before}) or end past the payload's {body.numel()} bytes"
            )
        end_before = end
        data = body[start:end]
        if data.storage_offset() % kind.itemsize:
            data = data.clone()
        out[name] = data.view(kind).view(shape)
    return out


def _data_start(entry: Any) -> int:
    """Where a header entry's bytes start, for checking them in order (anything malformed first)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    return offsets[0] if isinstance(offsets, list) and offsets and type(offsets[0]) is int else -1


def _checked_entry(name: str, entry: Any) -> tuple[int, int, list[int], Any]:
    """(start, end, shape, torch dtype) of a safetensors header entry; ValueError naming the tensor
    unless the offsets, shape and dtype are well formed and agree."""
    fields = entry if isinstance(entry, dict) else {}
    offsets, shape, dtype = fields.get("data_offsets"), fields.get("shape"), fields.get("dtype")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(x) is int and x >= 0 for x in offsets)
        or not isinstance(shape, list)
        or not all(type(n) is int and n >= 0 for n in shape)
        or dtype not in TORCH_DTYPE_NAMES
    ):
        raise ValueError(
            f"safetensors tensor {name!r}: needs data_offsets [start, end], a shape of integers >= 0 and a dtype "
            f"of {sorted(TORCH_DTYPE_NAMES)}, got {str(entry)[:160]}"
        )
    kind = getattr(torch, TORCH_DTYPE_NAMES[dtype])
    start, end = offsets
    if end - start != math.prod(shape) * kind.itemsize:
        raise ValueError(f"safetensors tensor {name!r}: {end - start} bytes for shape {shape} of {dtype}")
    return start, end, shape, kind


# ------------------------------------------------------------ the worker's files and host cache

_SAFETENSORS_SUFFIX = ".safetensors"


def files_signature(model_dir: str) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of each safetensors file: changes when the directory is rewritten."""
    out = []
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(_SAFETENSORS_SUFFIX):
            st = os.stat(os.path.join(model_dir, name))
            out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def write_whole(path: str, data: bytes) -> None:
    """`data` at `path`, replaced at once (written beside it, then renamed): a reader sees the old
    file or the new, and workers writing the same bytes there at once do not interleave."""
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)


def keep_newest(root: str, keep: int) -> None:
    """Remove all but the `keep` highest-versioned "v<N>" directories under `root`."""
    versions = sorted((int(name[1:]), name) for name in os.listdir(root) if name[:1] == "v" and name[1:].isdigit())
    for _, name in versions[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def keep_in_cache(cache: dict[str, Any], incoming: dict[str, Any]) -> None:
    """The host cache of checkpoint weights updated with `incoming`: a tensor of the same dtype and
    shape is copied into the cache's own (memory mapped already, and off the receive buffer), any other
    stored as a host copy."""
    for name, tensor in incoming.items():
        kept = cache.get(name)
        if kept is not None and kept.dtype == tensor.dtype and kept.shape == tensor.shape:
            kept.copy_(tensor)
        else:
            cache[name] = tensor.to("cpu", copy=True)


def read_dir(path: str) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(_SAFETENSORS_SUFFIX):
            tensors.update(load_file(os.path.join(path, name), device="cpu"))
    return tensors


# ------------------------------------------------------------ held loads


class HeldLoads:
    """An attested sync's second half, mixed into the worker extension (whose `_rollouts_load` and
    `_rollouts_base_weights` it uses): a receive with hold=<token> keeps its tensors unloaded and
    answers their checksums; the trainer, once it compared them with its own, loads them
    (`rollouts_commit`) or drops them (`rollouts_discard`), naming the same token. Weights that fail
    attestation are never loaded. A receive drops whatever is held before it takes any buffer."""

    _rollouts_held: tuple[str, dict[str, Any], bool] | None = None
    """The held receive: its token, its tensors (views of the receive buffer or of IPC buffers, which
    the next receive reuses) and whether they are owned (host tensors of their own)."""

    def _rollouts_hold(self, hold: str, incoming: dict[str, Any], *, owned: bool) -> bool:
        """Hold `incoming` under token `hold` (True); hold="0" holds nothing (False: the caller loads)."""
        if not 0 < len(hold) <= 64:
            raise ValueError(f"hold must be '0' or a sync's token of 1-64 characters, got {hold[:80]!r}")
        self._rollouts_held = None if hold == "0" else (hold, incoming, owned)
        return self._rollouts_held is not None

    def rollouts_commit(self, token: str) -> dict[str, Any]:
        """Reload with the tensors that receive `token` held: the trainer found their checksums equal
        to its own. Answers how many and the load's seconds."""
        held = self._rollouts_held
        if held is None or held[0] != token:
            found = "none is held" if held is None else f"the one held is {held[0]!r}"
            raise RuntimeError(f"commit of receive {token!r}: {found} (a later receive, or a discard, dropped it)")
        self._rollouts_held = None
        seconds: dict[str, float] = {}
        self._rollouts_load(self._rollouts_base_weights(), held[1], seconds, owned=held[2])  # type: ignore[attr-defined]
        return {"num_tensors": len(held[1]), "seconds": seconds}

    def rollouts_discard(self, token: str) -> dict[str, Any]:
        """Drop, unloaded, the tensors that receive `token` held (their checksums disagreed with the
        trainer's, or its sync failed before the check); another receive's are left as they are."""
        held = self._rollouts_held
        if held is None or held[0] != token:
            return {"num_tensors": 0}
        self._rollouts_held = None
        return {"num_tensors": len(held[1])}
