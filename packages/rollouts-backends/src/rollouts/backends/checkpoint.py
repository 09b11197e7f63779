"""Crash-safe checkpoints, exact resume, and weight export in HF safetensors format.

A checkpoint is a directory `root/step_<n>/`:
  config.json, model.safetensors   HF format, loadable by transformers / vLLM / SGLang as they are
  optimizer.safetensors            AdamW moments and step counts, keyed "<parameter name>::<key>"
  (or optimizer-rank<r>-of-<w>.safetensors: under FSDP2 one file per rank with its own shards)
  state.json                       TrainingState, `extra`, scheduler and optimizer hyper-parameters,
                                   RNG states (torch, numpy, python) and the size + CRC-32 of every file
It is written under `root/.tmp-step_<n>-<pid>`, every file fsynced, then renamed: a crash at any
instant leaves either the previous checkpoints or a complete new one. `latest_checkpoint` trusts
a directory only if every file matches what state.json recorded. Old checkpoints are renamed away
at once and deleted on a background thread; with `wait=False` the flush and the rename happen
there too, overlapping training (one checkpoint in flight at a time).

Under FSDP2 the full (unsharded) weights are gathered to rank 0, which writes model.safetensors;
every rank writes its own optimizer shards (no rank ever holds the full optimizer state), so
`root` must be on a file system all ranks see. Each shard file's metadata records where its
tensors sit in the full ones. Loading on the same layout reads only the rank's own file; on
another world size (or without FSDP) the shards are put back together and re-split.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import json
import logging
import mmap
import os
import random
import re
import shutil
import sys
import threading
import uuid
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from rollouts.backends.components import TrainingComponents
from rollouts.backends.lora import adapter_state_dict, has_lora, merge_lora_tensors
from rollouts.backends.lora_files import ADAPTER_WEIGHTS, load_adapter_dir, write_adapter_files
from rollouts.types import TrainingState

__all__ = [
    "export_weights",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "read_weights",
    "save_checkpoint",
    "step_checkpoints",
    "sweep_temporary",
    "verify_checkpoint",
    "wait_for_checkpoint",
]

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_KEY_SEP = "::"
_DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
"""HF's default shard size: one file per 5 GiB keeps any single write and load bounded."""
_CRC_BLOCK_BYTES = 64 * 1024**2
"""Read size when verifying a file's CRC-32 (bounded memory for multi-GiB weights)."""
_WRITE_CHUNK_BYTES = 16 * 1024**2
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


# ---------------------------------------------------------------- file helpers


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: names created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes | memoryview, *, sync: bool = True) -> dict[str, int]:
    """Write (and fsync unless `sync=False`); returns {"bytes", "crc32"} (CRC-32 catches torn and truncated writes)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _write_json(path: Path, obj: Any, *, sync: bool = True) -> dict[str, int]:
    return _write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode(), sync=sync)


def _write_config(path: Path, model: torch.nn.Module, *, sync: bool = True) -> dict[str, int]:
    return _write_bytes(path, model.config.to_json_string(use_diff=False).encode(), sync=sync)


def _libc_function(name: str, argtypes: list[Any]) -> Any:
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
    return fn


_sync_file_range = _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_SYNC_FILE_RANGE_WRITE = 2
_renameat2 = _libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
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
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


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
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], *, sync: bool = True
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
                for start in range(0, len(data), _WRITE_CHUNK_BYTES):
                    chunk = data[start : start + _WRITE_CHUNK_BYTES]
                    pool.submit(checksum, chunk)
                    _write_all(fd, chunk)
                    written += len(chunk)
                    if sync and written - synced >= _WRITE_CHUNK_BYTES:
                        _start_writeback(fd, synced, written - synced)
                        synced = written
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": written, "crc32": crc[0]}


def _write_tensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], *, sync: bool = True
) -> dict[str, int]:
    """Write a safetensors file, durably (fsynced) unless `sync=False`; returns its size and CRC-32."""
    if _can_stream(tensors):
        return _stream_tensors(path, tensors, metadata, sync=sync)
    safetensors.torch.save_file(dict(tensors), str(path), metadata=dict(metadata))
    with open(path, "rb") as f, ThreadPoolExecutor(max_workers=1) as pool:
        synced = pool.submit(os.fsync if sync else int, f.fileno())  # both release the GIL: disk flush || checksum
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            crc = zlib.crc32(view)
            size = len(view)
        synced.result()
    return {"bytes": size, "crc32": crc}


def _file_matches(path: Path, record: Mapping[str, int]) -> bool:
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


def _verify_files(components: TrainingComponents, path: Path, files: Mapping[str, Any], names: list[str]) -> None:
    """Raise ValueError naming every file in `names` whose size or CRC-32 differs from state.json's record
    (on every rank under FSDP2, so none waits in a collective for a rank that refused)."""

    def check() -> None:
        bad = [n for n in names if not _file_matches(path / n, files[n])]
        if bad:
            raise ValueError(
                f"checkpoint {str(path)!r}: {bad} do not match the size and CRC-32 recorded in state.json "
                "(corrupt or truncated)"
            )

    if _is_distributed(components.model):
        _on_all_ranks(check)
    else:
        check()


def _to_trash(path: Path, root: Path) -> Path:
    """Rename a directory out of the way (so no half-deleted copy ever keeps its old name); returns
    the new name, for `_delete_later`. Leftover trash is cleared by the next save."""
    trash = root / f"{_TRASH_PREFIX}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    return trash


def _delete(trash: list[Path]) -> None:
    for path in trash:
        shutil.rmtree(path, ignore_errors=True)


def _delete_later(trash: list[Path]) -> None:
    """Delete renamed-away directories on the background thread: freeing a multi-GB file's blocks
    takes long (about 0.1 s per 200 MB here) and nothing waits on it."""
    if trash:
        _publisher.start(lambda: _delete(trash))


def _publish(tmp: Path, final: Path) -> list[Path]:
    """Atomically give the complete directory `tmp` the name `final`; returns what to delete.

    Replacing an existing `final` swaps the two in one step where the kernel can (renameat2), so
    no instant is without a `final`; elsewhere the old one is renamed away first.
    """
    _fsync_path(tmp)
    trash: list[Path] = []
    if final.exists():
        if _exchange(tmp, final):
            _fsync_path(final.parent)
            return [tmp]  # now the old directory, under a temporary name the next save clears
        trash.append(_to_trash(final, final.parent))
    os.rename(tmp, final)
    _fsync_path(final.parent)
    return trash


# ---------------------------------------------------------------- state dicts


def _is_distributed(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "device_mesh") for p in model.parameters())


def _rank() -> int:
    return torch.distributed.get_rank() if _distributed_ready() else 0


def _distributed_ready() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _all_ok(ok: bool) -> bool:
    """Whether `ok` holds on every rank (an all-reduce, so also a barrier); `ok` itself in one process."""
    if not _distributed_ready():
        return ok
    flag = torch.tensor([int(ok)], device=_collective_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _on_all_ranks(fn: Any) -> Any:
    """fn() on this rank; if it raised on any rank, raise on every rank, so that no rank is left
    waiting in a collective for one that failed (a full disk on rank 0, say)."""
    try:
        result = fn()
    except Exception:
        _all_ok(False)
        raise
    if not _all_ok(True):
        raise RuntimeError(f"checkpoint I/O failed on another rank (rank {_rank()} is fine): see that rank's error")
    return result


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named full weights on CPU; a tensor tied to an earlier one (lm_head = embeddings) is left out."""
    if _is_distributed(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu").contiguous()
    return merge_lora_tensors(model, out) if has_lora(model) else out


def _optimizer_state(components: TrainingComponents) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Full optimizer state as flat tensors '<param name>::<key>' and JSON param groups."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(components.model, components.optimizer, options=options)
    tensors = {}
    for name, entries in state.get("state", {}).items():
        for key, value in entries.items():
            tensors[f"{name}{_KEY_SEP}{key}"] = torch.as_tensor(value).detach().to("cpu").contiguous()
    return tensors, _json_param_groups(state)


def _json_param_groups(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state.get("param_groups", [])]


def _shard_info(tensor: Any) -> dict[str, Any] | None:
    """Where a DTensor's local shard sits in the full tensor ({shape, dim, index, count}); None for a
    plain (replicated) tensor such as AdamW's step count."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return None
    mesh, placements = tensor.device_mesh, tensor.placements
    sharded = [(mesh_dim, p) for mesh_dim, p in enumerate(placements) if not isinstance(p, Replicate)]
    if len(sharded) > 1 or any(type(p) is not Shard for _, p in sharded):  # (not _StridedShard: FSDP + TP)
        raise ValueError(
            f"cannot save optimizer state with placements {placements}: one Shard(dim) mesh dimension at most"
        )
    if not sharded:
        return {"shape": list(tensor.shape), "dim": 0, "index": 0, "count": 1}
    mesh_dim, placement = sharded[0]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the optimizer state's device mesh")
    return {
        "shape": list(tensor.shape),
        "dim": placement.dim,
        "index": coordinate[mesh_dim],
        "count": mesh.size(mesh_dim),
    }


def _sharded_optimizer_state(
    components: TrainingComponents,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[dict[str, Any]]]:
    """This rank's optimizer shards as flat tensors, their layout {flat key: shard_of info}, and the param groups."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(components.model, components.optimizer)
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    for name, entries in state.get("state", {}).items():
        for key, value in entries.items():
            flat = f"{name}{_KEY_SEP}{key}"
            info = _shard_info(value)
            if info is not None:
                layout[flat] = info
                value = value.to_local()
            tensors[flat] = torch.as_tensor(value).detach().to("cpu").contiguous()
    return tensors, layout, _json_param_groups(state)


def _optimizer_shard_name(rank: int, world: int) -> str:
    return f"optimizer-rank{rank:05d}-of-{world:05d}.safetensors"


def _collective_device() -> torch.device:
    """Where tensors for collectives must live: the current CUDA device under NCCL, else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_file_records(record: Mapping[str, int]) -> list[dict[str, int]]:
    """Every rank's {"bytes", "crc32"} of the file it wrote, in rank order (a tensor all-gather, no pickles)."""
    dist = torch.distributed
    mine = torch.tensor([record["bytes"], record["crc32"]], dtype=torch.int64, device=_collective_device())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [{"bytes": int(t[0]), "crc32": int(t[1])} for t in gathered]


def _read_shard_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors of one optimizer shard file and the layout recorded in its metadata."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        layout = json.loads((f.metadata() or {}).get("layout", "{}"))
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return tensors, layout


def _join_shards(shard_files: list[Path]) -> dict[str, torch.Tensor]:
    """Full optimizer tensors from per-rank shard files (one copy per shard index, joined along the shard dim)."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    infos: dict[str, dict[str, Any]] = {}
    full: dict[str, torch.Tensor] = {}
    for path in shard_files:
        tensors, layout = _read_shard_file(path)
        for key, tensor in tensors.items():
            info = layout.get(key)
            if info is None:
                full.setdefault(key, tensor)  # replicated: every rank holds the same value
                continue
            infos[key] = info
            pieces.setdefault(key, {})[info["index"]] = tensor
    for key, info in infos.items():
        found = pieces[key]
        if sorted(found) != list(range(info["count"])):
            raise ValueError(f"optimizer state {key!r}: shards {sorted(found)} found, {info['count']} expected")
        joined = torch.cat([found[i] for i in range(info["count"])], dim=info["dim"])
        if list(joined.shape) != info["shape"]:
            raise ValueError(f"optimizer state {key!r}: shards join to {list(joined.shape)}, recorded {info['shape']}")
        full[key] = joined
    return full


def _unflatten_optimizer(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    state: dict[str, dict[str, Any]] = {}
    for key, tensor in flat.items():
        name, entry = key.rsplit(_KEY_SEP, 1)
        state.setdefault(name, {})[entry] = tensor
    return state


def _local_layout_matches(components: TrainingComponents, layout: Mapping[str, Any]) -> bool:
    """Whether this rank's own optimizer shards would have exactly the recorded layout."""
    params = dict(components.model.named_parameters())
    for key, info in layout.items():
        param = params.get(key.rsplit(_KEY_SEP, 1)[0])
        if param is None or not hasattr(param, "device_mesh"):
            return False
        if _shard_info(param) != info:
            return False
    return True


def _load_optimizer(components: TrainingComponents, path: Path, record: Mapping[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    files = record["files"]
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in record["optimizer_param_groups"]]
    shard_files = sorted(n for n in files if n.startswith("optimizer-rank"))
    if "optimizer.safetensors" in files:
        _verify_files(components, path, files, ["optimizer.safetensors"])
        flat = safetensors.torch.load_file(str(path / "optimizer.safetensors"))
    elif shard_files:
        own = _optimizer_shard_name(_rank(), len(shard_files))
        if _is_distributed(components.model) and torch.distributed.get_world_size() == len(shard_files):
            _verify_files(components, path, files, [own])  # each rank reads (and checks) only its own shard
            tensors, layout = _read_shard_file(path / own)
            # Same decision on every rank (set_optimizer_state_dict is collective): agree on it.
            if _all_ok(_local_layout_matches(components, layout)):
                params = dict(components.model.named_parameters())
                local: dict[str, Any] = {}
                for key, tensor in tensors.items():
                    if key in layout:
                        param = params[key.rsplit(_KEY_SEP, 1)[0]]
                        tensor = DTensor.from_local(
                            tensor.to(param.to_local().device),
                            param.device_mesh,
                            param.placements,
                            run_check=False,
                            shape=param.shape,
                            stride=param.stride(),
                        )
                    local[key] = tensor
                set_optimizer_state_dict(
                    components.model,
                    components.optimizer,
                    {"state": _unflatten_optimizer(local), "param_groups": groups},
                )
                return
        _verify_files(components, path, files, shard_files)
        flat = _join_shards([path / n for n in shard_files])
    else:
        raise ValueError(f"checkpoint {str(path)!r} holds no optimizer state (saved with save_optimizer=False)")
    set_optimizer_state_dict(
        components.model,
        components.optimizer,
        {"state": _unflatten_optimizer(flat), "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def _restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    # The lambdas are rebuilt from the OptimizerConfig; only the counters are state.
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


# ---------------------------------------------------------------- public API


def save_checkpoint(
    components: TrainingComponents,
    state: TrainingState,
    root: str | Path,
    *,
    extra: Mapping[str, Any] | None = None,
    keep_last: int = 2,
    save_optimizer: bool = True,
    tokenizer: Any = None,
    wait: bool = True,
) -> Path:
    """Write `root/step_<state.step>/` atomically and keep the newest `keep_last`; returns its path.

    `extra` is any JSON-ready mapping (e.g. DataBuffer state) given back by `load_checkpoint`.
    Under FSDP2 every rank must call it (the gather is collective); rank 0 writes the weights and
    every rank its optimizer shards.

    With `wait=False` it returns as soon as every byte is handed to the operating system (training
    may change the weights from then on); a background thread then fsyncs, publishes the directory
    under its final name and applies retention, so the disk flush overlaps training. Until then the
    checkpoint is invisible (a crash loses it and leaves the previous ones). The next save,
    `latest_checkpoint` and `wait_for_checkpoint` wait for it, and re-raise any error it hit; so
    does interpreter exit (bounded by `_EXIT_WAIT_S`).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}: it would delete the checkpoint just written")
    extra_json = json.loads(json.dumps(dict(extra or {})))  # fail early (TypeError) on non-JSON extra
    _on_all_ranks(lambda: _publisher.wait(None))  # one checkpoint in flight at a time, published in order
    root = Path(root)
    final = root / f"step_{state.step}"
    distributed = _is_distributed(components.model)
    lora = has_lora(components.model)  # LoRA: the adapter alone, in PEFT's format
    weights = adapter_state_dict(components.model) if lora else _model_tensors(components.model)
    files: dict[str, dict[str, int]] = {}
    optim_groups: list[dict[str, Any]] = []
    if distributed:
        # A fixed name every rank can compute; rank 0 clears leftovers before anyone writes.
        world = torch.distributed.get_world_size()
        tmp = root / f"{_TMP_PREFIX}{final.name}-ranks{world}"
        _on_all_ranks(lambda: _prepare_tmp(root, tmp) if _rank() == 0 else None)
        if save_optimizer:
            shards, layout, optim_groups = _sharded_optimizer_state(components)
            name = _optimizer_shard_name(_rank(), world)
            # Durable before the records are gathered: rank 0 publishes once they are in.
            mine = _on_all_ranks(
                lambda: _write_tensors(tmp / name, shards, {"layout": json.dumps(layout, sort_keys=True)})
            )
            for r, record in enumerate(_gather_file_records(mine)):
                files[_optimizer_shard_name(r, world)] = record
    else:
        tmp = root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"

    def write() -> None:  # rank 0
        nonlocal optim_groups
        if not distributed:
            _prepare_tmp(root, tmp)
            if save_optimizer:
                optim_tensors, optim_groups = _optimizer_state(components)
                files["optimizer.safetensors"] = _write_tensors(
                    tmp / "optimizer.safetensors", optim_tensors, {}, sync=wait
                )
        if lora:
            files.update(write_adapter_files(tmp, components.model, weights, _write_json, _write_tensors, sync=wait))
        else:
            files["config.json"] = _write_config(tmp / "config.json", components.model, sync=wait)
            files["model.safetensors"] = _write_tensors(tmp / "model.safetensors", weights, {"format": "pt"}, sync=wait)
        tokenizer_files: list[Path] = []
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
            tokenizer_files = [p for p in tmp.rglob("*") if p.is_file() and p.name not in files]
            for p in tokenizer_files:  # covered by the integrity check like every other file
                data = p.read_bytes()
                files[str(p.relative_to(tmp))] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        record = {
            "format_version": FORMAT_VERSION,
            "training_state": state.to_dict(),
            "extra": extra_json,
            "files": dict(sorted(files.items())),
            "optimizer_param_groups": optim_groups,
            "scheduler": _scheduler_state(components.scheduler),
            "rng": _rng_state(),
        }
        # state.json is written last: its presence with matching records marks a complete set.
        _write_json(tmp / "state.json", record, sync=wait)
        unsynced = tokenizer_files if wait else [p for p in tmp.rglob("*") if p.is_file()]

        def finish() -> list[Path]:
            for path in unsynced:
                _fsync_path(path)
            trash = _publish(tmp, final)
            return trash + [_to_trash(old, root) for old in _retired(root, final, keep_last)]

        if wait:
            _delete_later(finish())
        else:
            _publisher.start(lambda: _delete(finish()))

    # (Under torch.distributed without FSDP the model is replicated: rank 0 saves for everyone.)
    _on_all_ranks(write if _rank() == 0 else lambda: None)
    return final


class _Publisher:
    """At most one checkpoint being flushed and published by a background thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    def start(self, finish: Any) -> None:
        self.wait(None)

        def run() -> None:
            try:
                finish()
            except Exception as error:  # handed to whoever waits next
                self._error = error

        self._thread = threading.Thread(target=run, name="rollouts-checkpoint-publish", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"a checkpoint is still being published after {timeout} s")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"publishing a checkpoint in the background failed: {error!r}") from error


_publisher = _Publisher()
_EXIT_WAIT_S = 600.0
"""How long interpreter exit waits for a checkpoint still being published (a multi-GB flush)."""


def _wait_at_exit() -> None:
    try:
        _publisher.wait(_EXIT_WAIT_S)
    except (RuntimeError, TimeoutError) as error:
        print(f"rollouts: the last checkpoint was not published: {error}", file=sys.stderr)


atexit.register(_wait_at_exit)


def wait_for_checkpoint(timeout: float | None = None) -> None:
    """Block until a checkpoint saved with `wait=False` is durable and published (re-raising its error).

    Under torch.distributed every rank must call it: rank 0 publishes, and the others learn that it
    is done (or that it failed) from it.
    """
    _on_all_ranks(lambda: _publisher.wait(timeout))


def _prepare_tmp(root: Path, tmp: Path) -> None:
    """Create `root` and an empty `tmp` in it, clearing what interrupted saves left behind."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.iterdir():
        if stale.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()


def _retired(root: Path, final: Path, keep_last: int) -> list[Path]:
    """The step directories retention deletes after publishing `final`: the oldest beyond
    `keep_last` (counting `final`, never deleted), skipping any whose record is unreadable or whose
    files are missing or of another size than recorded (a full CRC check is the loader's): a
    checkpoint that fails its check is left for the user to look at, with a warning."""
    others = [d for d in _step_dirs(root) if d != final]
    excess = others[: max(0, len(others) - (keep_last - 1))]
    out = []
    for path in excess:
        problems = _cheap_problems(path)
        if problems:
            log.warning(
                "retention keeps %s: it failed its check (%s); delete it yourself if it is not needed",
                path,
                "; ".join(problems),
            )
        else:
            out.append(path)
    return out


def _cheap_problems(path: Path) -> list[str]:
    """What is wrong with a checkpoint directory short of reading its files: record and sizes."""
    record = _read_record(path)
    if record is None:
        return ["state.json missing, unreadable or of another format"]
    problems = []
    for name, entry in record.get("files", {}).items():
        try:
            size = (path / name).stat().st_size
        except OSError:
            problems.append(f"{name} is missing")
            continue
        if not isinstance(entry, Mapping) or size != entry.get("bytes"):
            problems.append(
                f"{name} is {size} bytes, recorded {entry.get('bytes') if isinstance(entry, Mapping) else entry!r}"
            )
    return problems


def verify_checkpoint(path: str | Path, *, full: bool = True) -> list[str]:
    """What is wrong with the checkpoint at `path` (empty: nothing): its record (state.json) must be
    readable and every file it lists present with the recorded size and (`full`: reading every
    byte) CRC-32. load_checkpoint runs the full check itself."""
    path = Path(path)
    problems = _cheap_problems(path)
    if problems or not full:
        return problems
    record = _read_record(path)
    assert record is not None
    files = record.get("files", {})
    if not _weights_file(files):
        return ["state.json lists no model.safetensors (nor adapter_model.safetensors)"]
    return [
        f"{n} does not match its recorded CRC-32 (damaged)" for n, r in files.items() if not _file_matches(path / n, r)
    ]


def step_checkpoints(root: str | Path) -> list[Path]:
    """Every step_<n> directory under `root`, newest first, verified or not (see verify_checkpoint).

    Waits for this process's background save first."""
    _publisher.wait(None)
    return list(reversed(_step_dirs(Path(root))))


def sweep_temporary(directory: str | Path) -> list[Path]:
    """Delete what interrupted saves and exports left in `directory` (half-written checkpoints and
    weights, renamed-away old ones); returns what was removed. Only safe while no other process
    saves into it (the loops hold the run directory's lock)."""
    _publisher.wait(None)  # this process's own background save is not a leftover: let it finish
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        if entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _step_dirs(root: Path) -> list[Path]:
    """step_<n> directories under root, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format_version") != FORMAT_VERSION:
        return None
    return record


def _weights_file(files: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's record lists its weights: the full model or (LoRA) the adapter."""
    return "model.safetensors" in files or ADAPTER_WEIGHTS in files


def has_optimizer_state(path: str | Path) -> bool:
    """Whether the checkpoint at `path` holds optimizer state (it was saved with save_optimizer=True)."""
    record = _read_record(Path(path))
    files = record.get("files", {}) if record is not None else {}
    return any(n == "optimizer.safetensors" or n.startswith("optimizer-rank") for n in files)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (every file matches state.json), or None.

    It waits for this process's background save. Under torch.distributed the other ranks see a
    background save only once rank 0 has published it: call `wait_for_checkpoint()` on every rank first.
    """
    _publisher.wait(None)
    for path in reversed(_step_dirs(Path(root))):
        record = _read_record(path)
        if record is None:
            continue
        files = record.get("files", {})
        if _weights_file(files) and all(_file_matches(path / n, r) for n, r in files.items()):
            return path
    return None


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors directory (one file or an index of shards), on CPU.

    Waits first for this process's background save, which may be the directory asked for.
    """
    _publisher.wait(None)
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in names:
        out.update(safetensors.torch.load_file(str(directory / name)))
    return out


def load_model_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-named full weights into `model` (sharded or not); tied weights may be absent."""
    if _is_distributed(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    result = model.load_state_dict(tensors, strict=False)
    own = model.state_dict()
    storages = {(t.untyped_storage().data_ptr(), t.storage_offset()) for n, t in own.items() if n in tensors}
    untied_missing = [
        n for n in result.missing_keys if (own[n].untyped_storage().data_ptr(), own[n].storage_offset()) not in storages
    ]
    if untied_missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint weights do not fit the model: missing {untied_missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


def load_checkpoint(
    components: TrainingComponents,
    path: str | Path,
    *,
    load_optimizer: bool = True,
    restore_rng: bool = True,
) -> tuple[TrainingState, dict[str, Any]]:
    """Restore weights, optimizer, scheduler and RNG from a checkpoint; returns (TrainingState, extra).

    Every file is checked against the size and CRC-32 that state.json records (a ValueError names
    the ones that differ). `load_optimizer=False` keeps the optimizer's current moments (a
    checkpoint saved with `save_optimizer=False` needs it; see `has_optimizer_state`); the
    scheduler's position is restored either way. Waits for a background save still being
    published (on every rank under FSDP2, where loading is collective anyway).
    """
    if _is_distributed(components.model):
        _on_all_ranks(lambda: _publisher.wait(None))
    else:
        _publisher.wait(None)
    path = Path(path)
    record = _read_record(path)
    if record is None or not _weights_file(record.get("files", {})):
        raise ValueError(f"{str(path)!r} is not a checkpoint: state.json missing, unreadable or of another format")
    files = record["files"]
    _verify_files(components, path, files, [n for n in files if not n.startswith("optimizer")])
    if ADAPTER_WEIGHTS in files:
        load_adapter_dir(components.model, path)
    else:
        load_model_weights(components.model, read_weights(path))
    if load_optimizer:
        _load_optimizer(components, path, record)
    components.scheduler.load_state_dict(
        {**record["scheduler"], "lr_lambdas": [None] * len(components.optimizer.param_groups)}
    )
    if not load_optimizer:  # the loaded param groups would carry it; fresh ones start at the step's lr
        for group, lr in zip(components.optimizer.param_groups, components.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    if restore_rng:
        _restore_rng(record["rng"])
    return TrainingState.from_dict(record["training_state"]), dict(record["extra"])


def export_weights(
    components: TrainingComponents,
    directory: str | Path,
    *,
    max_shard_bytes: int = _DEFAULT_MAX_SHARD_BYTES,
    durable: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """Write HF safetensors weights (sharded above `max_shard_bytes`) + config.json + manifest.json.

    Returns (directory, manifest) with manifest = {"tensors": {name: {shape, dtype, file}},
    "files": {file: {bytes, crc32}}, "total_bytes", "checksum"}. The directory is replaced
    atomically, so a reader never sees a partial set. Under FSDP2 every rank calls it; rank 0
    writes and gets the manifest, others {}.

    For weight sync the files are read back at once from the page cache, so by default they are
    not fsynced (an operating-system crash loses them along with the engine that would read
    them; the manifest's CRCs tell). `durable=True` flushes them first, for weights meant to last.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    directory = Path(directory)
    weights = _model_tensors(components.model)
    manifest = _on_all_ranks(
        lambda: _write_export(components, weights, directory, max_shard_bytes, durable) if _rank() == 0 else {}
    )
    return directory, manifest


def _write_export(
    components: TrainingComponents,
    weights: dict[str, torch.Tensor],
    directory: Path,
    max_shard_bytes: int,
    durable: bool,
) -> dict[str, Any]:
    _publisher.wait(None)  # one background job at a time (a pending deletion, a publish)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in weights.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    if len(shards) == 1:
        file_names = ["model.safetensors"]
    else:
        file_names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f"{_TMP_PREFIX}{directory.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files = {}
    tensors_meta = {}
    for file_name, shard in zip(file_names, shards, strict=True):
        files[file_name] = _write_tensors(tmp / file_name, shard, {"format": "pt"}, sync=durable)
        for name, tensor in shard.items():
            tensors_meta[name] = {
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "file": file_name,
            }
    total_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    if len(shards) > 1:
        weight_map = {name: meta["file"] for name, meta in tensors_meta.items()}
        _write_json(
            tmp / "model.safetensors.index.json",
            {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
            sync=durable,
        )
    _write_config(tmp / "config.json", components.model, sync=durable)
    checksum = 0
    for file_name in file_names:
        checksum = zlib.crc32(files[file_name]["crc32"].to_bytes(4, "little"), checksum)
    manifest = {"tensors": tensors_meta, "files": files, "total_bytes": total_bytes, "checksum": checksum}
    _write_json(tmp / "manifest.json", manifest, sync=durable)
    _delete_later(_publish(tmp, directory))
    return manifest
