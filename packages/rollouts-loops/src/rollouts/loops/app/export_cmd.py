"""`rollouts export CHECKPOINT OUT [--merge] [--base DIR]`: a checkpoint as a model others load.

A LoRA checkpoint (the adapter alone, PEFT's format) is written as that adapter (for
`peft.PeftModel.from_pretrained`, or vLLM's --lora-modules) or, with --merge, as a merged HF model
(base weights + alpha/r * B @ A) that transformers, vLLM and SGLang load as the base architecture.
The base model is the one the adapter records (adapter_config.json's base_model_name_or_path) or
--base; one the adapter was not trained on is refused. A full checkpoint is written as its HF
weights. Tokenizer files found beside the weights (or the base) are copied too.

    rollouts export runs/rl/checkpoints/step_50 merged/ --merge
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from rollouts.backends import build_components, export_weights, load_checkpoint, verify_checkpoint
from rollouts.backends.checkpoint.lora_files import ADAPTER_CONFIG, save_adapter
from rollouts.types import LoraConfig, OptimizerConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def _copy_tokenizer(source: Path, out: Path) -> None:
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, merge: bool = False, base: str | None = None) -> Path:
    """Write `checkpoint` to `out` as described in this module's docstring; returns `out`."""
    checkpoint, out = Path(checkpoint), Path(out)
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise ValueError(f"checkpoint {str(checkpoint)!r} fails its check: {'; '.join(problems)}")
    if not (checkpoint / ADAPTER_CONFIG).is_file():
        if base is not None:
            raise ValueError(f"--base {base!r} is for LoRA checkpoints; {str(checkpoint)!r} holds full weights")
        components = build_components(checkpoint, OptimizerConfig(), num_training_steps=1)
        export_weights(components, out, durable=True)
        _copy_tokenizer(checkpoint, out)
        return out
    saved = json.loads((checkpoint / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    base_dir = Path(base or saved.get("base_model_name_or_path") or "")
    if not (base_dir / "config.json").is_file():
        source = "--base" if base else "adapter_config.json's base_model_name_or_path"
        raise ValueError(f"base model {str(base_dir)!r} ({source}) is not a local model directory: pass --base DIR")
    lora = LoraConfig(
        rank=int(saved["r"]),
        alpha=float(saved["lora_alpha"]),
        target_modules=tuple(saved["target_modules"]),
    )
    components = build_components(base_dir, OptimizerConfig(), num_training_steps=1, lora=lora, dtype=torch.float32)
    load_checkpoint(components, checkpoint, load_optimizer=False, restore_rng=False)
    if merge:
        export_weights(components, out, durable=True)
    else:
        save_adapter(components.model, out)
    _copy_tokenizer(checkpoint if (checkpoint / "tokenizer.json").is_file() else base_dir, out)
    return out


def cmd_export(args: argparse.Namespace) -> int:
    """Exit 0 with the directory printed, or 2 with what is wrong (a damaged checkpoint, a wrong base)."""
    try:
        out = export_checkpoint(args.checkpoint, args.out, merge=args.merge, base=args.base)
    except ValueError as e:
        print(f"rollouts export: {e}", file=sys.stderr)
        return 2
    print(f"exported: {out}")
    return 0
