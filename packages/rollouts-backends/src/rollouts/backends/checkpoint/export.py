"""Weights out of a training model: HF-named full tensors (gathered under FSDP2, LoRA merged),
written as an HF safetensors directory for an engine to load (`export_weights`), and read back
(`read_weights`, `load_model_weights`).
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any, cast

import safetensors.torch
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from rollouts.backends.checkpoint.durable import (
    TMP_PREFIX,
    delete_dirs,
    publish_dir,
    write_config,
    write_generation_config,
    write_json,
    write_tensors,
)
from rollouts.backends.checkpoint.writer import CheckpointWriter
from rollouts.backends.train.components import TrainingComponents
from rollouts.backends.train.distributed import is_distributed, on_all_ranks, rank_world
from rollouts.backends.train.lora import has_lora, merge_lora_tensors

__all__ = ["export_weights", "load_model_weights", "model_tensors", "read_weights"]


_DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
"""HF's default shard size: one file per 5 GiB keeps any single write and load bounded."""


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """Where `tensor`'s data starts: tied weights (lm_head = embeddings) share one key."""
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset())  # (an int but for symbolic shapes)


def model_tensors(model: torch.nn.Module, *, keep_device: bool = False) -> dict[str, torch.Tensor]:
    """HF-named full weights on CPU (`keep_device`: where an unsharded model holds them, for a
    load that copies them at once); a tensor tied to an earlier one (lm_head = embeddings) is left out."""
    if is_distributed(model):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state = cast("dict[str, torch.Tensor]", full)  # a model's state dict holds tensors only
    else:
        state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in state.items():
        key = storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous() if keep_device else tensor.detach().to("cpu").contiguous()
    return merge_lora_tensors(model, out) if has_lora(model) else out


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors directory (one file or an index of shards), on CPU."""
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
    if is_distributed(model):
        # (a copy typed as the dict of torch's wider value type it declares)
        set_model_state_dict(model, dict(tensors), options=StateDictOptions(full_state_dict=True, strict=False))
        return
    result = model.load_state_dict(tensors, strict=False)
    own = model.state_dict()
    storages = {storage_key(t) for n, t in own.items() if n in tensors}
    untied_missing = [n for n in result.missing_keys if storage_key(own[n]) not in storages]
    if untied_missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint weights do not fit the model: missing {untied_missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


def export_weights(
    components: TrainingComponents,
    directory: str | Path,
    *,
    max_shard_bytes: int = _DEFAULT_MAX_SHARD_BYTES,
    durable: bool = False,
    writer: CheckpointWriter | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Write HF safetensors weights (sharded above `max_shard_bytes`) + config.json + manifest.json.

    Returns (directory, manifest) with manifest = {"tensors": {name: {shape, dtype, file}},
    "files": {file: {bytes, crc32}}, "total_bytes", "checksum"}. The directory is replaced
    atomically, so a reader never sees a partial set. Under FSDP2 every rank calls it; rank 0
    writes and gets the manifest, others {}.

    For weight sync the files are read back at once from the page cache, so by default they are
    not fsynced (an operating-system crash loses them along with the engine that would read
    them; the manifest's CRCs tell). `durable=True` flushes them first, for weights meant to last.
    The replaced directory is deleted before returning, or on `writer`'s thread when one is given.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    directory = Path(directory)
    weights = model_tensors(components.model)
    manifest = on_all_ranks(
        lambda: (
            _write_export(components, weights, directory, max_shard_bytes, durable, writer)
            if rank_world()[0] == 0
            else {}
        )
    )
    return directory, manifest


def _write_export(
    components: TrainingComponents,
    weights: dict[str, torch.Tensor],
    directory: Path,
    max_shard_bytes: int,
    durable: bool,
    writer: CheckpointWriter | None,
) -> dict[str, Any]:
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
    # A name of its own for each export: swapped into place, the previous weights take this
    # directory's name and are deleted on `writer`'s thread, possibly while the next export starts.
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{directory.name}-{os.getpid()}-", dir=directory.parent))
    files = {}
    tensors_meta = {}
    for file_name, shard in zip(file_names, shards, strict=True):
        files[file_name] = write_tensors(tmp / file_name, shard, {"format": "pt"}, sync=durable)
        for name, tensor in shard.items():
            tensors_meta[name] = {
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "file": file_name,
            }
    total_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    if len(shards) > 1:
        weight_map = {name: meta["file"] for name, meta in tensors_meta.items()}
        write_json(
            tmp / "model.safetensors.index.json",
            {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
            sync=durable,
        )
    write_config(tmp / "config.json", components.model, sync=durable)
    write_generation_config(tmp, components.model, sync=durable)
    checksum = 0
    for file_name in file_names:
        checksum = zlib.crc32(files[file_name]["crc32"].to_bytes(4, "little"), checksum)
    manifest = {"tensors": tensors_meta, "files": files, "total_bytes": total_bytes, "checksum": checksum}
    write_json(tmp / "manifest.json", manifest, sync=durable)
    trash = publish_dir(tmp, directory)
    if writer is None:
        delete_dirs(trash)
    else:  # freeing a multi-GB file's blocks takes long (~0.1 s per 200 MB here): on the writer's thread
        writer.submit(lambda: delete_dirs(trash))
    return manifest
