"""The torch side of rollouts.sync.fingerprint (whose docstring gives the definition), the numpy
arithmetic both sides share, and the fault hook for tests of attestation: standard library and numpy
only, torch taken from the tensors it is given.

vLLM's workers import it beside the worker extension: the launcher copies both files into the
server's PYTHONPATH, where rollouts.sync itself is not installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
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
    torch = sys.modules["torch"]  # loaded already: `tensor` is one of its tensors
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return checksum_bytes(flat.numpy())
    nbytes = int(flat.numel())
    if nbytes % 4 or flat.storage_offset() % 4:  # an unaligned or ragged byte view cannot be read as words
        flat = torch.cat([flat, flat.new_zeros(-nbytes % 4)])
    words = flat.view(torch.int32)
    size = _GPU_CHUNK_WORDS
    weights = torch.arange(1, min(words.numel(), size) + 1, dtype=torch.int64, device=words.device)
    parts = []
    for start in range(0, words.numel(), size):
        chunk = words[start : start + size].to(torch.int64) & 0xFFFFFFFF  # unsigned words
        parts.append(torch.stack([(chunk * weights[: chunk.numel()]).sum(), chunk.sum()]))
    pairs = torch.stack(parts).tolist() if parts else []  # one device sync for the whole tensor
    return combine([p[0] for p in pairs], [p[1] for p in pairs], nbytes, size)


def fingerprint_torch(tensors: Mapping[str, Any]) -> dict[str, int]:
    """{name: checksum} of torch tensors, each computed on its own device."""
    return {name: checksum_torch(value) for name, value in tensors.items()}


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
