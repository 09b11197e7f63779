"""TrainingComponents and the factories that build them: model, AdamW, learning-rate schedule.

The bundle holds torch objects that change in place (weights, optimizer moments, scheduler
counter); everything that counts progress lives in the immutable `TrainingState` instead.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollouts.backends.train import attention
from rollouts.backends.train.cpu_memory import retain_freed_cpu_memory
from rollouts.types import LoraConfig, OptimizerConfig

__all__ = [
    "TrainingComponents",
    "build_components",
    "build_optimizer",
    "build_scheduler",
    "load_hf_model",
    "lr_multiplier",
    "model_attr",
    "set_model_attr",
    "use_document_attention",
]

_NO_DECAY_NAME_PARTS = ("norm", "bias")
"""Parameters whose name contains one of these never decay (AdamW convention for LLMs)."""


@dataclass(slots=True, kw_only=True)
class TrainingComponents:
    """The torch objects of a run; functions in this package update them in place."""

    model: torch.nn.Module
    """A causal LM (transformers `PreTrainedModel`, possibly sharded with FSDP2)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device


def model_attr(model: torch.nn.Module, name: str) -> Any:
    """`model.<name>` for an attribute a transformers model (or rollouts) adds to a Module: `config`,
    `base_model`, `get_output_embeddings`, ... torch types every attribute it does not declare as
    `Tensor | Module` (a parameter, buffer or submodule); these are neither, so they are read as Any."""
    return getattr(model, name)


def set_model_attr(model: torch.nn.Module, name: str, value: object) -> None:
    """Set a plain (not tensor, not submodule) attribute on a Module, which torch's `__setattr__`
    is typed to refuse."""
    setattr(model, name, value)


def check_model_dir(path: str | Path, *, tokenizer: bool = False) -> None:
    """Check a local HF model directory before anything is loaded: config.json parses, its weights
    are there (model.safetensors, or the shards its index names) and each file is as long as its
    header says (a truncated copy is named here, not deep inside a loader); with `tokenizer`, that
    tokenizer files are present. Reads only the files' headers."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json: expected a local HF-format model directory")
    try:
        json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index (weight_map): {e!r}") from None
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(
            f"model path {str(path)!r} has no model.safetensors (nor an index of shards): "
            "rollouts loads safetensors weights only"
        )
    for name in files:
        _check_safetensors_length(path / name)
    if tokenizer and not any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        raise ValueError(
            f"model path {str(path)!r} has no tokenizer (tokenizer.json / tokenizer_config.json): "
            "save one there or set model.tokenizer_path"
        )


def _check_safetensors_length(file: Path) -> None:
    """The file holds its 8-byte header length, the JSON header and every tensor's bytes."""
    if not file.is_file():
        raise ValueError(f"weights file {file} is missing")
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
        if header_len < 2 or 8 + header_len > size:
            raise ValueError(
                f"weights file {file} is truncated or not safetensors ({size} bytes; header length {header_len})"
            )
        try:
            header = json.loads(f.read(header_len))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"weights file {file} has an unreadable safetensors header: {e!r}") from None
    if 8 + header_len + end != size:
        raise ValueError(
            f"weights file {file} is {size} bytes but its header describes {8 + header_len + end}: "
            "truncated or damaged (copy it again)"
        )


def load_hf_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """Load a local HF-format causal LM directory (config.json + safetensors); never downloads.

    "sdpa" on CUDA loads as DOCUMENT_SDPA: packed rows attend through FlexAttention (train.attention).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    check_model_dir(path)
    cuda_sdpa = attn_implementation == "sdpa" and torch.device(device).type == "cuda"
    if cuda_sdpa or attn_implementation == attention.DOCUMENT_SDPA:
        attn_implementation = attention.register()
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    return model.to(torch.device(device))


def use_document_attention(model: torch.nn.Module) -> None:
    """Switch an "sdpa" model to DOCUMENT_SDPA: the same SDPA for every mask but a packed row's,
    which attends through FlexAttention within each sequence (train.attention). Others unchanged."""
    if getattr(model_attr(model, "config"), "_attn_implementation", None) == "sdpa":
        model_attr(model, "set_attn_implementation")(attention.register())


def _decays(name: str, param: torch.Tensor) -> bool:
    return param.ndim >= 2 and not any(part in name.lower() for part in _NO_DECAY_NAME_PARTS)


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (never on norms, biases or other vectors)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model has no trainable parameters: nothing for the optimizer to update")
    decay = [p for n, p in named if _decays(n, p)]
    no_decay = [p for n, p in named if not _decays(n, p)]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    kwargs = _adamw_implementation([p for _, p in named])
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, **kwargs)


def _adamw_implementation(params: list[torch.Tensor]) -> dict[str, bool]:
    """Which of torch's AdamW implementations updates `params` fastest: the fused kernel for plain
    weights on CPU or CUDA (every tensor in one call), the multi-tensor (foreach) kernels for sharded (DTensor) weights on CUDA,
    else (other tensor subclasses, other devices, a mix) the per-tensor loop. Each gives the same
    bits on a rerun, so exact-resume comparisons stay bitwise."""
    device_types = {p.device.type for p in params}
    plain = all(type(p) is torch.nn.Parameter for p in params)
    if plain and len(device_types) == 1 and device_types <= {"cpu", "cuda"}:
        return {"fused": True}
    if device_types == {"cuda"} and all(_is_dtensor(p) for p in params):
        return {"foreach": True}
    return {"foreach": False}


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(tensor, DTensor)


def lr_multiplier(step: int, *, config: OptimizerConfig, num_training_steps: int) -> float:
    """Learning rate at optimizer step `step` as a fraction of `config.lr` (warm-up, then schedule)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    decay_steps = max(1, num_training_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    floor = config.min_lr_ratio
    if config.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimizerConfig, *, num_training_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up then cosine, linear or constant learning rate over `num_training_steps` steps."""
    if num_training_steps < 1:
        raise ValueError(f"num_training_steps must be >= 1, got {num_training_steps}")
    fn = functools.partial(lr_multiplier, config=config, num_training_steps=num_training_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def build_components(
    model_path: str | Path | torch.nn.Module,
    config: OptimizerConfig,
    *,
    num_training_steps: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    lora: LoraConfig | None = None,
) -> TrainingComponents:
    """Model (loaded from a local path, or given), AdamW and schedule, bundled. On CUDA an "sdpa"
    model attends through DOCUMENT_SDPA (`use_document_attention`).

    With `lora` (rank > 0) the model gets a PEFT LoRA adapter and the optimizer holds only its weights.
    On CPU, glibc's malloc is told to keep freed memory for reuse (`retain_freed_cpu_memory`).
    """
    if isinstance(model_path, torch.nn.Module):
        model = model_path.to(torch.device(device))
        if torch.device(device).type == "cuda":
            use_document_attention(model)
    else:
        model = load_hf_model(model_path, dtype=dtype, device=device, attn_implementation=attn_implementation)
    if lora is not None and lora.enabled:
        from rollouts.backends.train.lora import apply_lora

        model = apply_lora(model, lora)
    if torch.device(device).type == "cpu":
        retain_freed_cpu_memory()  # each step reuses the last one's activation memory (cpu_memory.py)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, num_training_steps=num_training_steps)
    return TrainingComponents(model=model, optimizer=optimizer, scheduler=scheduler, device=torch.device(device))
