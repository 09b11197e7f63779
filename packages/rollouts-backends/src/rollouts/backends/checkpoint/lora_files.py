"""LoRA adapters on disk in PEFT's format: adapter_config.json + adapter_model.safetensors.

A directory written here loads with `peft.PeftModel.from_pretrained(base, directory)` (and in
vLLM as a LoRA adapter). Beside PEFT's two files, rollouts_adapter.json records the fingerprint of
the base model the adapter was trained on, so loading it into another base model is refused.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from rollouts.backends.train.distributed import rank_world
from rollouts.backends.train.lora import (
    adapter_config_dict,
    adapter_state_dict,
    has_lora,
    load_adapter_tensors,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_META",
    "ADAPTER_WEIGHTS",
    "load_adapter_dir",
    "save_adapter",
    "write_adapter_files",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_META = "rollouts_adapter.json"


def _meta(model: torch.nn.Module) -> dict[str, Any]:
    return {
        "base_fingerprint": getattr(model, "rollouts_base_fingerprint", None),
        "base_model_name_or_path": getattr(getattr(model, "config", None), "name_or_path", "") or None,
    }


def write_adapter_files(
    directory: Path,
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    write_json: Callable[..., dict[str, int]],
    write_tensors: Callable[..., dict[str, int]],
    *,
    sync: bool = True,
) -> dict[str, dict[str, int]]:
    """Write the adapter's three files into `directory` with the given writers; returns their records."""
    return {
        ADAPTER_CONFIG: write_json(directory / ADAPTER_CONFIG, adapter_config_dict(model), sync=sync),
        ADAPTER_WEIGHTS: write_tensors(directory / ADAPTER_WEIGHTS, tensors, {"format": "pt"}, sync=sync),
        ADAPTER_META: write_json(directory / ADAPTER_META, _meta(model), sync=sync),
    }


def save_adapter(model: torch.nn.Module, directory: str | Path) -> Path:
    """Write the model's adapter to `directory` in PEFT's format, replacing it atomically (rename).

    Under FSDP2 every rank calls it (the gather is collective); rank 0 writes.
    """
    directory = Path(directory)
    tensors = adapter_state_dict(model)
    if rank_world()[0] != 0:
        return directory
    tmp = directory.with_name(f".tmp-{directory.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config_dict(model), indent=2, sort_keys=True))
        safetensors.torch.save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_META).write_text(json.dumps(_meta(model), indent=2))
        if directory.exists():
            old = directory.with_name(f".old-{directory.name}-{uuid.uuid4().hex[:8]}")
            directory.rename(old)
            tmp.rename(directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is missing or not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_adapter_dir(model: torch.nn.Module, directory: str | Path) -> None:
    """Load the PEFT adapter in `directory` into `model`'s adapter (from apply_lora with the same config).

    Refused, naming the value: a rank or target modules other than the model's adapter, and an
    adapter trained on another base model (rollouts_adapter.json's fingerprint).
    """
    directory = Path(directory)
    if not has_lora(model):
        raise ValueError(f"{str(directory)!r} holds a LoRA adapter but the model has none: set model.lora.rank")
    saved, mine = _read_json(directory / ADAPTER_CONFIG), adapter_config_dict(model)
    for key in ("r", "lora_alpha", "target_modules"):
        if saved.get(key) != mine.get(key):
            raise ValueError(
                f"{directory / ADAPTER_CONFIG}: {key} = {saved.get(key)!r} but the model's adapter has {mine.get(key)!r}"
            )
    base = (
        _read_json(directory / ADAPTER_META).get("base_fingerprint") if (directory / ADAPTER_META).is_file() else None
    )
    tensors = safetensors.torch.load_file(str(directory / ADAPTER_WEIGHTS))
    load_adapter_tensors(model, tensors, base=base, source=str(directory))
