"""Crash-safe checkpoints and exact resume.

A checkpoint is a directory `root/step_<n>/`:
  config.json, model.safetensors   HF format, loadable by transformers / vLLM / SGLang as they are
  optimizer.safetensors            AdamW moments and step counts, keyed "<parameter name>::<key>"
  (or optimizer-rank<r>-of-<w>.safetensors: under FSDP2 one file per rank with its own shards)
  state.json                       TrainingState, `extra`, scheduler and optimizer hyper-parameters,
                                   RNG states (torch, numpy, python) and the size + CRC-32 of every file
(a LoRA model's checkpoint holds its adapter in PEFT's format instead of the full weights).
It is written under `root/.tmp-step_<n>-<pid>`, every file fsynced, then renamed: a crash at any
instant leaves either the previous checkpoints or a complete new one (checkpoint_dirs.py lists,
verifies and retires them; durable.py writes; optimizer_state.py shards the optimizer). With a
`CheckpointWriter` the flush, the rename and the deletion of old checkpoints happen on the
writer's thread, overlapping training; the caller owns the writer and closes it.

Under FSDP2 the full (unsharded) weights are gathered to rank 0, which writes model.safetensors;
every rank writes its own optimizer shards (no rank ever holds the full optimizer state), so
`root` must be on a file system all ranks see.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from rollouts.backends.checkpoint.dirs import FORMAT_VERSION, read_record, retired, verify_files, weights_file
from rollouts.backends.checkpoint.durable import (
    TMP_PREFIX,
    TRASH_PREFIX,
    delete_dirs,
    fsync_path,
    publish_dir,
    to_trash,
    write_config,
    write_generation_config,
    write_json,
    write_tensors,
)
from rollouts.backends.checkpoint.export import load_model_weights, model_tensors, read_weights
from rollouts.backends.checkpoint.lora_files import ADAPTER_WEIGHTS, load_adapter_dir, write_adapter_files
from rollouts.backends.checkpoint.optimizer_state import (
    full_optimizer_state,
    load_optimizer_state,
    optimizer_shard_name,
    sharded_optimizer_state,
)
from rollouts.backends.checkpoint.writer import CheckpointWriter
from rollouts.backends.train.components import TrainingComponents
from rollouts.backends.train.distributed import collective_device, is_distributed, on_all_ranks, rank_world
from rollouts.backends.train.lora import adapter_state_dict, has_lora
from rollouts.types import TrainingState

__all__ = ["load_checkpoint", "save_checkpoint"]


def _gather_file_records(record: Mapping[str, int]) -> list[dict[str, int]]:
    """Every rank's {"bytes", "crc32"} of the file it wrote, in rank order (a tensor all-gather, no pickles)."""
    dist = torch.distributed
    mine = torch.tensor([record["bytes"], record["crc32"]], dtype=torch.int64, device=collective_device())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [{"bytes": int(t[0]), "crc32": int(t[1])} for t in gathered]


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    if isinstance(np_state, dict):  # the legacy global generator is always MT19937, whose state is a tuple
        raise TypeError(f"numpy's global random state is not MT19937's tuple: {sorted(np_state)}")
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


def save_checkpoint(
    components: TrainingComponents,
    state: TrainingState,
    root: str | Path,
    *,
    extra: Mapping[str, Any] | None = None,
    keep_last: int = 2,
    save_optimizer: bool = True,
    tokenizer: Any = None,
    writer: CheckpointWriter | None = None,
    models: Mapping[str, torch.nn.Module] | None = None,
) -> Path:
    """Write `root/step_<state.step>/` atomically and keep the newest `keep_last`; returns its path.

    `extra` is any JSON-ready mapping (e.g. DataBuffer state) given back by `load_checkpoint`.
    `models`: further models saved with it, each as `<name>.safetensors` (full weights; e.g. a KL
    reference that moves during training), checked like every file and loaded by `load_checkpoint(models=)`.
    Under FSDP2 every rank must call it (the gather is collective); rank 0 writes the weights and
    every rank its optimizer shards.

    Without a `writer` it returns once the checkpoint is durable and published and old ones are
    deleted. With one it returns as soon as every byte is handed to the operating system (training
    may change the weights from then on); the writer's thread then fsyncs, publishes the directory
    under its final name and applies retention, so the disk flush overlaps training. Until then the
    checkpoint is invisible (a crash loses it and leaves the previous ones); `writer.wait()` or
    `writer.close()` waits for it and raises its error, as does the next save through the writer.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}: it would delete the checkpoint just written")
    extra_json = json.loads(json.dumps(dict(extra or {})))  # fail early (TypeError) on non-JSON extra
    _check_model_names(models or {})
    more = {name: model_tensors(model) for name, model in (models or {}).items()}  # collective under FSDP2
    if writer is not None:
        writer.wait()  # one checkpoint in flight at a time, published in order (every rank learns of a failure)
    wait = writer is None
    root = Path(root)
    final = root / f"step_{state.step}"
    distributed = is_distributed(components.model)
    lora = has_lora(components.model)  # LoRA: the adapter alone, in PEFT's format
    weights = adapter_state_dict(components.model) if lora else model_tensors(components.model)
    files: dict[str, dict[str, int]] = {}
    optim_groups: list[dict[str, Any]] = []
    if distributed:
        # A fixed name every rank can compute; rank 0 clears leftovers before anyone writes.
        world = torch.distributed.get_world_size()
        tmp = root / f"{TMP_PREFIX}{final.name}-ranks{world}"
        on_all_ranks(lambda: _prepare_tmp(root, tmp) if rank_world()[0] == 0 else None)
        if save_optimizer:
            shards, layout, optim_groups = sharded_optimizer_state(components)
            name = optimizer_shard_name(rank_world()[0], world)
            # Durable before the records are gathered: rank 0 publishes once they are in.
            mine = on_all_ranks(
                lambda: write_tensors(tmp / name, shards, {"layout": json.dumps(layout, sort_keys=True)})
            )
            for r, record in enumerate(_gather_file_records(mine)):
                files[optimizer_shard_name(r, world)] = record
    else:
        tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"

    def write() -> None:  # rank 0
        nonlocal optim_groups
        if not distributed:
            _prepare_tmp(root, tmp)
            if save_optimizer:
                optim_tensors, optim_groups = full_optimizer_state(components)
                files["optimizer.safetensors"] = write_tensors(
                    tmp / "optimizer.safetensors", optim_tensors, {}, sync=wait
                )
        if lora:
            files.update(write_adapter_files(tmp, components.model, weights, write_json, write_tensors, sync=wait))
        else:
            files["config.json"] = write_config(tmp / "config.json", components.model, sync=wait)
            files.update(write_generation_config(tmp, components.model, sync=wait))
            files["model.safetensors"] = write_tensors(tmp / "model.safetensors", weights, {"format": "pt"}, sync=wait)
        for name, tensors in more.items():
            files[f"{name}.safetensors"] = write_tensors(
                tmp / f"{name}.safetensors", tensors, {"format": "pt"}, sync=wait
            )
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
        write_json(tmp / "state.json", record, sync=wait)
        unsynced = tokenizer_files if wait else [p for p in tmp.rglob("*") if p.is_file()]

        def finish() -> list[Path]:
            for path in unsynced:
                fsync_path(path)
            trash = publish_dir(tmp, final)
            return trash + [to_trash(old, root) for old in retired(root, final, keep_last)]

        if writer is None:
            delete_dirs(finish())
        else:
            writer.submit(lambda: delete_dirs(finish()))

    # (Under torch.distributed without FSDP the model is replicated: rank 0 saves for everyone.)
    on_all_ranks(write if rank_world()[0] == 0 else lambda: None)
    return final


def _check_model_names(models: Mapping[str, torch.nn.Module]) -> None:
    """Further models' names: lowercase words, none a file a checkpoint already has."""
    for name in models:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in ("model", "optimizer", "adapter_model", "state"):
            raise ValueError(
                f"checkpoint model name {name!r} must be lowercase letters, digits and _ and not one of "
                "model, optimizer, adapter_model, state"
            )


def _prepare_tmp(root: Path, tmp: Path) -> None:
    """Create `root` and an empty `tmp` in it, clearing what interrupted saves left behind."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.iterdir():
        if stale.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()


def load_checkpoint(
    components: TrainingComponents,
    path: str | Path,
    *,
    load_optimizer: bool = True,
    restore_rng: bool = True,
    models: Mapping[str, torch.nn.Module] | None = None,
) -> tuple[TrainingState, dict[str, Any]]:
    """Restore weights, optimizer, scheduler and RNG from a checkpoint; returns (TrainingState, extra).
    `models`: load the further models `save_checkpoint(models=)` saved into these (a name it did not
    save is a ValueError naming it).

    Every file is checked against the size and CRC-32 that state.json records (a ValueError names
    the ones that differ). `load_optimizer=False` keeps the optimizer's current moments (a
    checkpoint saved with `save_optimizer=False` needs it; see `has_optimizer_state`); the
    scheduler's position is restored either way.
    """
    path = Path(path)
    record = read_record(path)
    if record is None or not weights_file(record.get("files", {})):
        raise ValueError(f"{str(path)!r} is not a checkpoint: state.json missing, unreadable or of another format")
    files = record["files"]
    verify_files(components, path, files, [n for n in files if not n.startswith("optimizer")])
    _check_model_names(models or {})
    missing = [name for name in models or {} if f"{name}.safetensors" not in files]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} holds no {missing} model (saved: {sorted(files)})")
    if ADAPTER_WEIGHTS in files:
        load_adapter_dir(components.model, path)
    else:
        load_model_weights(components.model, read_weights(path))
    for name, model in (models or {}).items():
        load_model_weights(model, safetensors.torch.load_file(str(path / f"{name}.safetensors")))
    if load_optimizer:
        load_optimizer_state(components, path, record)
    components.scheduler.load_state_dict(
        {**record["scheduler"], "lr_lambdas": [None] * len(components.optimizer.param_groups)}
    )
    if not load_optimizer:  # the loaded param groups would carry it; fresh ones start at the step's lr
        for group, lr in zip(components.optimizer.param_groups, components.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
    if restore_rng:
        _restore_rng(record["rng"])
    return TrainingState.from_dict(record["training_state"]), dict(record["extra"])
