"""Durable, atomic file I/O for checkpoints and exported weights.

Files are written whole and fsynced (or left to the page cache where the caller says so), with the
size and CRC-32 of what was written, so a later reader can tell a torn or truncated file. Tensors
stream into safetensors files chunk by chunk straight from their memory, each chunk's disk
write-back started at once (Linux sync_file_range) and checksummed on a second thread. A directory
gets its final name atomically (renameat2 RENAME_EXCHANGE where the kernel has it), so a reader
sees the old set or the new one, never a mix.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import shutil
import sys
import uuid
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import safetensors.torch
import torch

from rollouts.backends.train.components import model_attr

__all__ = [
    "ATOMIC_EXCHANGE",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "WRITE_CHUNK_BYTES",
    "delete_dirs",
    "file_matches",
    "fsync_path",
    "publish_dir",
    "to_trash",
    "write_bytes",
    "write_config",
    "write_generation_config",
    "write_json",
    "write_tensors",
]

TMP_PREFIX = ".tmp-"
"""Name prefix of a directory being written (cleared by the next save or sweep)."""
TRASH_PREFIX = ".trash-"
"""Name prefix of a directory renamed away before its deletion."""

_CRC_BLOCK_BYTES = 64 * 1024**2
"""Read size when verifying a file's CRC-32 (bounded memory for multi-GiB weights)."""


WRITE_CHUNK_BYTES = 16 * 1024**2
"""Write size when streaming tensors to disk; each chunk's write-back starts as soon as it is written."""


_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    **{
        dtype: name
        for attr, name in [
            ("float8_e4m3fn", "F8_E4M3"),
            ("float8_e5m2", "F8_E5M2"),
            ("uint16", "U16"),
            ("uint32", "U32"),
            ("uint64", "U64"),
        ]
        if (dtype := getattr(torch, attr, None)) is not None
    },
}
"""torch dtypes our streaming writer encodes, with their safetensors names; others go through save_file."""


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: names created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes | memoryview, *, sync: bool = True) -> dict[str, int]:
    """Write (and fsync unless `sync=False`); returns {"bytes", "crc32"} (CRC-32 catches torn and truncated writes)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def write_json(path: Path, obj: Any, *, sync: bool = True) -> dict[str, int]:
    return write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode(), sync=sync)


def write_config(path: Path, model: torch.nn.Module, *, sync: bool = True) -> dict[str, int]:
    return write_bytes(path, model_attr(model, "config").to_json_string(use_diff=False).encode(), sync=sync)


def write_generation_config(directory: Path, model: torch.nn.Module, *, sync: bool = True) -> dict[str, dict[str, int]]:
    """`generation_config.json` (the model's sampling defaults and stop tokens, which a server reads)
    as {file name: entry}, or {} for a model without one."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    name = "generation_config.json"
    return {name: write_bytes(directory / name, config.to_json_string(use_diff=True).encode(), sync=sync)}


def _libc_function(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """A Linux libc function with its argument types, or None where it is unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return cast("Callable[..., int]", fn)


_sync_file_range = _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_SYNC_FILE_RANGE_WRITE = 2
_renameat2 = _libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
ATOMIC_EXCHANGE = _renameat2 is not None
"""Whether replacing a directory swaps the two in one step (Linux renameat2); elsewhere the old one
is renamed away first, leaving an instant without it."""
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if _renameat2 is None:
        return False
    return _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing [offset, offset + nbytes) to disk now, without waiting (a hint only)."""
    global _sync_file_range
    if _sync_file_range is not None and _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0:
        _sync_file_range = None  # e.g. unsupported by the file system: fsync alone still makes it durable


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without copying when it is contiguous."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def _safetensors_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[bytes, list[str]]:
    """Length-prefixed, 8-byte-padded JSON header and the order of tensor data (largest dtype first, then name)."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return len(text).to_bytes(8, "little") + text, order


def _can_stream(tensors: Mapping[str, torch.Tensor]) -> bool:
    if sys.byteorder != "little":
        return False
    for tensor in tensors.values():
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.layout != torch.strided
            or tensor.dtype not in _SAFETENSORS_DTYPES
        ):
            return False
    return not any(len(names) > 1 for names in safetensors.torch._find_shared_tensors(dict(tensors)))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _stream_tensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], *, sync: bool, chunk_bytes: int
) -> dict[str, int]:
    """Write a safetensors file chunk by chunk straight from tensor memory, then fsync (unless
    `sync=False`); returns {"bytes", "crc32"}.

    The CRC-32 runs on a second thread over the same chunks as they are written. With `sync`, each
    chunk's disk write-back is started as soon as it is in the page cache, so the final fsync has
    little left to flush; without it no hint is given (starting write-back can block on a busy disk
    queue, which is what a caller not waiting for the disk wants to avoid).
    """
    header, order = _safetensors_header(tensors, metadata)
    crc = [zlib.crc32(header)]

    def checksum(chunk: memoryview) -> None:
        crc[0] = zlib.crc32(chunk, crc[0])  # releases the GIL: overlaps the write of the next chunk

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:  # one worker: chunks are checksummed in order
            _write_all(fd, memoryview(header))
            written = synced = len(header)
            for name in order:
                data = _tensor_bytes(tensors[name])
                for start in range(0, len(data), chunk_bytes):
                    chunk = data[start : start + chunk_bytes]
                    pool.submit(checksum, chunk)
                    _write_all(fd, chunk)
                    written += len(chunk)
                    if sync and written - synced >= chunk_bytes:
                        _start_writeback(fd, synced, written - synced)
                        synced = written
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": written, "crc32": crc[0]}


def write_tensors(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    sync: bool = True,
    chunk_bytes: int = WRITE_CHUNK_BYTES,
) -> dict[str, int]:
    """Write a safetensors file, durably (fsynced) unless `sync=False`; returns its size and CRC-32.

    Plain strided tensors of the dtypes safetensors knows, none sharing memory, stream from their
    own memory in `chunk_bytes` pieces, widest dtype first (each tensor aligned to its element
    size); anything else goes through safetensors' `save_file` (which refuses shared memory)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if _can_stream(tensors):
        return _stream_tensors(path, tensors, metadata, sync=sync, chunk_bytes=chunk_bytes)
    safetensors.torch.save_file(dict(tensors), str(path), metadata=dict(metadata))
    with open(path, "rb") as f, ThreadPoolExecutor(max_workers=1) as pool:
        synced = pool.submit(os.fsync if sync else int, f.fileno())  # both release the GIL: disk flush || checksum
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            crc = zlib.crc32(view)
            size = len(view)
        synced.result()
    return {"bytes": size, "crc32": crc}


def file_matches(path: Path, record: Mapping[str, int]) -> bool:
    try:
        if path.stat().st_size != record["bytes"]:
            return False
        crc = 0
        with open(path, "rb") as f:
            while block := f.read(_CRC_BLOCK_BYTES):
                crc = zlib.crc32(block, crc)
        return crc == record["crc32"]
    except (OSError, KeyError, TypeError):
        return False


def to_trash(path: Path, root: Path) -> Path:
    """Rename a directory out of the way (so no half-deleted copy ever keeps its old name); returns
    the new name, for `delete_dirs`. Leftover trash is cleared by the next save or sweep."""
    trash = root / f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    return trash


def delete_dirs(trash: list[Path]) -> None:
    for path in trash:
        shutil.rmtree(path, ignore_errors=True)


def publish_dir(tmp: Path, final: Path) -> list[Path]:
    """Atomically give the complete directory `tmp` the name `final`; returns what to delete.

    Replacing an existing `final` swaps the two in one step where the kernel can (renameat2), so
    no instant is without a `final`; elsewhere the old one is renamed away first.
    """
    fsync_path(tmp)
    trash: list[Path] = []
    if final.exists():
        if _exchange(tmp, final):
            fsync_path(final.parent)
            return [tmp]  # now the old directory, under a temporary name the next save clears
        trash.append(to_trash(final, final.parent))
    os.rename(tmp, final)
    fsync_path(final.parent)
    return trash
