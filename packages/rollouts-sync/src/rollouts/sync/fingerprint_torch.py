"""The torch side of rollouts.sync.fingerprint (whose docstring gives the definition), the numpy
arithmetic both sides share, and the fault hook for tests of attestation: standard library and numpy
only, torch taken from the tensors it is given.

vLLM's workers import it beside the worker extension: the launcher copies both files into the
server's PYTHONPATH, where rollouts.sync itself is not installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FAULT_ENV",
    "checksum_bytes",
    "checksum_torch",
    "combine",
    "fingerprint_torch",
    "flip_bit_torch",
    "sync_fault_target",
    "with_sync_fault",
]

FAULT_ENV = "ROLLOUTS_SYNC_FAULT"
_MASK = (1 << 64) - 1
_LENGTH_MIX = 0x9E3779B97F4A7C15  # an odd constant (2^64 / golden ratio): the length spread over all bits
_GPU_CHUNK_WORDS = 1 << 22  # few kernel launches per tensor on a GPU; 32 MiB temporaries
_CPU_CHUNK_WORDS = 1 << 16  # 512 KiB temporaries stay in cache: several times faster than 2^22 on CPU


def combine(weighted_sums: list[int], sums: list[int], nbytes: int, chunk_words: int) -> int:
    """The checksum from per-chunk sums (the same whatever the chunk size): chunk c (words
    c * chunk_words ..) adds sum_j (j + 1) w_j + c * chunk_words * sum_j w_j, j counted within the chunk."""
    total = 0
    for c, (weighted, plain) in enumerate(zip(weighted_sums, sums, strict=True)):
        total += (weighted & _MASK) + c * chunk_words * (plain & _MASK)
    return (total + nbytes * _LENGTH_MIX) & _MASK


def checksum_bytes(data: np.ndarray) -> int:
    """The checksum of [nbytes] uint8 `data` (a tensor's raw little-endian bytes), with numpy."""
    nbytes = int(data.nbytes)
    if nbytes % 4:
        data = np.concatenate([data, np.zeros(4 - nbytes % 4, dtype=np.uint8)])
    words = data.view("<u4")
    weights = np.arange(1, min(len(words), _CPU_CHUNK_WORDS) + 1, dtype=np.uint64)
    chunk = np.empty(min(len(words), _CPU_CHUNK_WORDS), dtype=np.uint64)
    weighted_sums, sums = [], []
    for start in range(0, len(words), _CPU_CHUNK_WORDS):
        part = chunk[: min(_CPU_CHUNK_WORDS, len(words) - start)]
        np.copyto(part, words[start : start + len(part)], casting="safe")  # widen into a reused buffer
        sums.append(int(part.sum(dtype=np.uint64)))
        np.multiply(part, weights[: len(part)], out=part)  # wraps mod 2^64, as the definition wants
        weighted_sums.append(int(part.sum(dtype=np.uint64)))
    return combine(weighted_sums, sums, nbytes, _CPU_CHUNK_WORDS)


def checksum_torch(tensor: Any) -> int:
    """The checksum of a torch tensor, computed where it lives: on a GPU with torch's int64 ops, on the
    CPU with numpy (several times faster than torch's CPU ops here, and the same int)."""
    return fingerprint_torch({"": tensor})[""]


def fingerprint_torch(tensors: Mapping[str, Any], cast: Callable[[Any], Any] | None = None) -> dict[str, int]:
    """{name: checksum} of torch tensors (each passed through `cast` first, e.g. to the engine's dtype),
    each computed on its own device. A GPU's sums stay on it until every tensor's are queued, then
    come back in one read per device: a sync of hundreds of tensors waits for its GPU once, not once
    per tensor."""
    torch = sys.modules["torch"]  # loaded already: the values are its tensors
    host: dict[str, int] = {}
    queued: dict[Any, list[tuple[str, Any, int]]] = {}  # device -> (name, [chunks, 2] int64 sums, nbytes)
    weights: dict[Any, Any] = {}  # device -> the chunk's word weights 1..n, made once per call
    for name, value in tensors.items():
        tensor = value.detach() if cast is None else cast(value.detach())
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        if _on_host(flat.device):
            host[name] = checksum_bytes(flat.numpy())
            continue
        need = min(-(-flat.numel() // 4), _GPU_CHUNK_WORDS)
        if flat.device not in weights or weights[flat.device].numel() < need:
            weights[flat.device] = torch.arange(1, need + 1, dtype=torch.int64, device=flat.device)
        queued.setdefault(flat.device, []).append((name, _device_sums(flat, weights[flat.device]), flat.numel()))
    for items in queued.values():
        rows = torch.cat([sums for _, sums, _ in items]).tolist()  # the one wait for this device
        for name, sums, nbytes in items:
            pairs, rows = rows[: len(sums)], rows[len(sums) :]
            host[name] = combine([p[0] for p in pairs], [p[1] for p in pairs], nbytes, _GPU_CHUNK_WORDS)
    return {name: host[name] for name in tensors}


def _on_host(device: Any) -> bool:
    """Whether a tensor on `device` is summed with numpy (the CPU) rather than with torch's ops where it lives."""
    return bool(device.type == "cpu")


def _device_sums(flat_u8: Any, weights: Any) -> Any:
    """[chunks, 2] int64 (sum_j (j + 1) w_j, sum_j w_j) per chunk of _GPU_CHUNK_WORDS little-endian
    uint32 words w of the [nbytes] uint8 `flat_u8`, computed on its device with no read back
    (int64 products and sums wrap mod 2^64, as the definition wants)."""
    torch = sys.modules["torch"]
    nbytes = int(flat_u8.numel())
    if nbytes % 4 or flat_u8.storage_offset() % 4:  # an unaligned or ragged byte view cannot be read as words
        flat_u8 = torch.cat([flat_u8, flat_u8.new_zeros(-nbytes % 4)])
    words = flat_u8.view(torch.int32)
    parts = []
    for start in range(0, words.numel(), _GPU_CHUNK_WORDS):
        chunk = words[start : start + _GPU_CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF  # unsigned words
        parts.append(torch.stack([(chunk * weights[: chunk.numel()]).sum(), chunk.sum()]))
    return torch.stack(parts) if parts else torch.zeros(0, 2, dtype=torch.int64, device=flat_u8.device)


def sync_fault_target(environ: Mapping[str, str] = os.environ) -> str | None:
    """The tensor name ROLLOUTS_SYNC_FAULT asks an engine to corrupt after receiving it (None: none)."""
    spec = environ.get(FAULT_ENV, "")
    if spec.startswith("file:"):
        path = Path(spec.removeprefix("file:"))
        spec = path.read_text().strip() if path.is_file() else ""
    if not spec:
        return None
    if not spec.startswith("corrupt:") or spec == "corrupt:":
        raise ValueError(f"{FAULT_ENV} must be 'corrupt:<tensor name>' or 'file:<path>', got {spec!r}")
    return spec.removeprefix("corrupt:")


def flip_bit_torch(tensor: Any) -> None:
    """Flip the lowest bit of `tensor`'s first byte, in place (the injected fault)."""
    torch = sys.modules["torch"]  # loaded already: `tensor` is one of its tensors
    if tensor.numel():
        tensor.detach().reshape(-1).view(torch.uint8)[0] ^= 1  # detached: a parameter changes in place too


def with_sync_fault(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` as received, with the fault ROLLOUTS_SYNC_FAULT asks for injected (a test hook)."""
    target = sync_fault_target()
    if target is not None and target in tensors:
        flip_bit_torch(tensors[target])
    return tensors
